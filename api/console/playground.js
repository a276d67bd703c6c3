// Playground: a streamed completion through the admin listener
// (/admin/v1/completions, /admin/v1/chat/completions), with the text as it
// arrives, cached_tokens and the prefix object of the answer.
import { api } from './api.js';
import { el, markReady } from './util.js';

// Splits an SSE byte stream into the data of its events.
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, '');
      const data = event.split(/\r?\n/).filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
      if (data) yield data;
    }
  }
}

// The text a chunk adds (completions: choices[].text; chat: choices[].delta.content).
function chunkText(chunk) {
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return '';
  if (typeof choice.text === 'string') return choice.text;
  if (choice.delta && typeof choice.delta.content === 'string') return choice.delta.content;
  return '';
}

function requestBody(controls, model) {
  const maxTokens = Number(controls.maxTokens.value) || 64;
  const body = {
    model,
    max_tokens: maxTokens,
    stream: true,
    stream_options: { include_usage: true },
  };
  const temperature = controls.temperature.value.trim();
  if (temperature !== '') body.temperature = Number(temperature);
  if (controls.endpoint.value === 'chat') body.messages = [{ role: 'user', content: controls.prompt.value }];
  else body.prompt = controls.prompt.value;
  return body;
}

export async function renderPlayground(page) {
  const { main } = page;
  const endpoint = el('select', { id: 'play-endpoint' },
    el('option', { value: 'completions' }, 'Completion'),
    el('option', { value: 'chat' }, 'Chat'));
  const model = el('select', { id: 'play-model' });
  const prompt = el('textarea', { id: 'play-prompt', rows: 8, spellcheck: 'false', placeholder: 'A prompt that starts with a registered prefix shows cached tokens.' });
  const namespace = el('input', { id: 'play-namespace', type: 'text', placeholder: '(default namespace)' });
  const maxTokens = el('input', { id: 'play-max-tokens', type: 'number', min: 1, max: 4096, value: 64 });
  const temperature = el('input', { id: 'play-temperature', type: 'number', min: 0, max: 2, step: 0.1, placeholder: 'default' });
  const submit = el('button', { id: 'play-submit', type: 'submit', class: 'primary' }, 'Send');
  const stopButton = el('button', { id: 'play-stop', type: 'button', disabled: true }, 'Stop');
  const form = el('form', { id: 'play-form', class: 'card form-grid' },
    el('div', { class: 'row' },
      el('div', { class: 'field' }, el('label', { for: 'play-endpoint' }, 'Endpoint'), endpoint),
      el('div', { class: 'field' }, el('label', { for: 'play-model' }, 'Model'), model),
      el('div', { class: 'field' }, el('label', { for: 'play-namespace' }, 'Namespace'), namespace)),
    el('div', { class: 'field' }, el('label', { for: 'play-prompt' }, 'Prompt'), prompt),
    el('div', { class: 'row' },
      el('div', { class: 'field' }, el('label', { for: 'play-max-tokens' }, 'Max tokens'), maxTokens),
      el('div', { class: 'field' }, el('label', { for: 'play-temperature' }, 'Temperature'), temperature)),
    el('div', { class: 'form-actions' }, submit, stopButton));
  const state = el('span', { id: 'play-status', class: 'state', 'data-state': 'idle' }, 'idle');
  const output = el('pre', { id: 'play-output', class: 'output' });
  const cached = el('span', { id: 'play-cached-tokens', class: 'big-number' }, '—');
  const usage = el('span', { class: 'muted' });
  const prefixJson = el('pre', { id: 'play-prefix', class: 'json' }, 'null');
  main.append(el('div', { class: 'page-head' }, el('h1', {}, 'Playground')),
    el('div', { class: 'two-col' }, form,
      el('div', { class: 'card' },
        el('h2', {}, 'Prompt cache'),
        el('div', {}, 'Cached tokens: ', cached, ' ', usage),
        el('h3', {}, 'prefix'), prefixJson)),
    el('div', { class: 'card' }, el('div', { class: 'output-head' }, el('h2', {}, 'Output'), state), output));

  let controller = null;
  const setState = (name, text) => {
    state.dataset.state = name;
    state.textContent = text || name;
  };
  try {
    const models = await api.listModels();
    for (const m of models.data || []) model.append(el('option', { value: m.id }, m.id));
  } catch (error) {
    setState('error', `Cannot list the models: ${error.message}`);
  }
  if (!page.alive()) return null;

  const run = async () => {
    controller = new AbortController();
    submit.disabled = true;
    stopButton.disabled = false;
    output.textContent = '';
    cached.textContent = '—';
    usage.textContent = '';
    prefixJson.textContent = 'null';
    setState('streaming', 'streaming…');
    try {
      const body = requestBody({ endpoint, prompt, maxTokens, temperature }, model.value);
      const response = await api.complete(endpoint.value, namespace.value, body, controller.signal);
      for await (const data of sseData(response)) {
        if (data === '[DONE]') break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || 'the stream ended with an error');
        output.textContent += chunkText(chunk);
        if (chunk.prefix !== undefined) prefixJson.textContent = JSON.stringify(chunk.prefix, null, 2);
        if (chunk.usage) {
          const details = chunk.usage.prompt_tokens_details || {};
          cached.textContent = String(details.cached_tokens ?? 0);
          usage.textContent = `of ${chunk.usage.prompt_tokens} prompt tokens; ${chunk.usage.completion_tokens} generated`;
        }
      }
      setState('done');
    } catch (error) {
      if (error.name === 'AbortError') setState('done', 'stopped');
      else setState('error', error.message);
    } finally {
      submit.disabled = false;
      stopButton.disabled = true;
      controller = null;
    }
  };
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    if (!controller) run();
  });
  stopButton.addEventListener('click', () => controller && controller.abort());
  markReady(main);
  return () => controller && controller.abort();
}
