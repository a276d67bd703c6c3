// Register: a text or a system message as a new prefix, with the daemon's
// own policy list, then the job's progress until it is stored.
import { api } from './api.js';
import { el, markReady, policyKey, policyName } from './util.js';

const POLL_MS = 300;

function field(label, control, hint) {
  return el('div', { class: 'field' },
    el('label', { for: control.id }, label), control, hint ? el('div', { class: 'hint' }, hint) : null);
}

// The policy's keys and defaults; for the daemon's default policy also the
// values compression.policy configures (what a registration without keys gets).
function keysTable(policy, configuredSpec) {
  if (!policy) return el('p', { class: 'muted' }, 'The daemon did not list its policies.');
  const configured = configuredSpec && policyName(configuredSpec) === policy.name;
  const head = el('tr', {}, el('th', {}, 'Key'), el('th', {}, 'Default'), configured ? el('th', {}, 'Configured') : null);
  const rows = (policy.keys || []).map((key) => {
    const value = configured ? policyKey(configuredSpec, key.name) : null;
    return el('tr', { class: value !== null && value !== key.default ? 'changed' : null },
      el('td', { class: 'mono' }, key.name), el('td', { class: 'mono' }, key.default),
      configured ? el('td', { class: 'mono' }, value ?? key.default) : null);
  });
  return el('div', {},
    el('p', { class: 'policy-summary' }, policy.summary || ''),
    configured ? el('p', { class: 'hint' }, 'The daemon\'s default policy: "Configured" is compression.policy, which a registration with this policy uses.') : null,
    rows.length
      ? el('table', { class: 'data compact' }, el('thead', {}, head), el('tbody', {}, rows))
      : el('p', { class: 'muted' }, 'This policy has no keys.'),
    el('p', { class: 'hint mono', title: 'canonical spec' }, configured ? configuredSpec : policy.spec || ''));
}

// The request body from the form's controls, or throws an Error naming what to fix.
function registrationBody(form, defaultSpec) {
  const text = form.text.value;
  if (!text.trim()) throw new Error('Enter the prefix text.');
  const body = form.mode.value === 'system' ? { messages: [{ role: 'system', content: text }] } : { text };
  const name = form.policy.value;
  // The daemon default's name stands for its configured spec, keys included.
  if (name) body.policy = defaultSpec && policyName(defaultSpec) === name ? defaultSpec : name;
  const retention = form.retention.value.trim();
  const quality = form.quality.value.trim();
  if (retention && quality) throw new Error('Give a retention or a quality budget, not both.');
  if (retention) {
    const r = Number(retention);
    if (!(r > 0 && r <= 1)) throw new Error('The retention is a fraction in (0, 1].');
    body.retention = r;
  }
  if (quality) {
    const q = Number(quality);
    if (!(q > 1 && q <= 10)) throw new Error('The quality budget (tau, the largest NLL ratio) is above 1 and at most 10.');
    body.quality = q;
  }
  if (form.namespace.value) body.namespace = form.namespace.value;
  if (form.pin.checked) body.pin = true;
  body.wait = false;
  return body;
}

function jobPanel() {
  const progress = el('progress', { id: 'job-progress', max: 1, value: 0 });
  const phase = el('span', { id: 'job-phase' }, 'queued');
  const percent = el('span', { class: 'muted' });
  const error = el('p', { id: 'job-error', class: 'error', hidden: true });
  const result = el('div', { class: 'job-result' });
  const title = el('h2', {}, 'Job');
  const panel = el('div', { id: 'job-status', class: 'card job', 'data-state': 'queued' },
    title, el('div', { class: 'job-line' }, progress, percent), el('div', {}, 'Phase: ', phase), error, result);
  const show = (job) => {
    panel.dataset.state = job.state;
    title.textContent = `Job ${job.id ?? ''}`;
    const value = Math.max(0, Math.min(1, job.progress ?? 0));
    progress.value = job.state === 'done' ? 1 : value;
    percent.textContent = `${Math.round(progress.value * 100)}%`;
    phase.textContent = job.phase || job.state;
    if (job.state === 'failed') {
      error.hidden = false;
      error.textContent = job.error || 'the job failed';
    }
    if (job.state === 'done' && job.prefix) {
      const chosen = job.chosen_retention !== null && job.chosen_retention !== undefined
        ? ` at retention ${job.chosen_retention}` : '';
      result.replaceChildren(
        el('p', {}, job.existed ? 'Already stored' : 'Stored', chosen, ': ',
          el('a', { id: 'job-prefix-link', href: `#/prefix/${job.prefix.id}` }, job.prefix.id)));
    }
  };
  return { panel, show };
}

export async function renderRegister(page) {
  const { main } = page;
  let timer = null;
  const stop = () => {
    if (timer) clearTimeout(timer);
    timer = null;
  };

  const mode = el('select', { id: 'register-mode', name: 'mode' },
    el('option', { value: 'text' }, 'Text (as a completion prompt)'),
    el('option', { value: 'system' }, 'System message (chat)'));
  const text = el('textarea', { id: 'register-text', name: 'text', rows: 9, spellcheck: 'false',
    placeholder: 'The prefix your requests start with: a system prompt, instructions, a document…' });
  const policy = el('select', { id: 'register-policy', name: 'policy' });
  const keys = el('div', { id: 'register-keys', class: 'keys' });
  const retention = el('input', { id: 'register-retention', name: 'retention', type: 'number', min: '0.01', max: '1', step: '0.01' });
  const quality = el('input', { id: 'register-quality', name: 'quality', type: 'number', min: '1.001', max: '10', step: '0.001', placeholder: 'none' });
  const namespace = el('input', { id: 'register-namespace', name: 'namespace', type: 'text', placeholder: '(default namespace)', maxlength: 127 });
  const pin = el('input', { id: 'register-pin', name: 'pin', type: 'checkbox' });
  const submit = el('button', { id: 'register-submit', type: 'submit', class: 'primary' }, 'Register');
  const formError = el('p', { id: 'register-form-error', class: 'error', role: 'alert', hidden: true });
  const form = el('form', { id: 'register-form', class: 'card form-grid', novalidate: true },
    field('Kind', mode, 'A system message is rendered with the model\'s chat template, as chat requests are.'),
    field('Prefix', text),
    el('div', { class: 'row' },
      field('Policy', policy),
      field('Retention', retention, 'Fraction of K/V rows kept; empty: the policy\'s default.'),
      field('Quality budget (tau)', quality, 'Largest NLL ratio allowed; calibration picks the retention.')),
    el('div', { class: 'row' },
      field('Namespace', namespace),
      el('div', { class: 'field checkbox' }, pin, el('label', { for: 'register-pin' }, 'Pin (never evicted)'))),
    el('div', { class: 'form-actions' }, submit, formError));
  const jobArea = el('div', { class: 'job-area' });
  main.append(el('div', { class: 'page-head' }, el('h1', {}, 'Register a prefix')), jobArea,
    el('div', { class: 'two-col' }, form, el('aside', { class: 'card' }, el('h2', {}, 'Policy'), keys)));

  let policies = [];
  let defaultSpec = '';
  const showKeys = () => {
    const chosen = policies.find((p) => p.name === policy.value);
    keys.replaceChildren(keysTable(chosen, defaultSpec));
    const builtin = chosen ? (chosen.keys || []).find((k) => k.name === 'retention') : null;
    const configured = chosen && policyName(defaultSpec) === chosen.name ? policyKey(defaultSpec, 'retention') : null;
    const value = configured ?? (builtin ? builtin.default : null);
    retention.placeholder = value ? `default ${value}` : 'policy default';
  };
  try {
    const list = await api.listPolicies();
    policies = list.data || [];
    defaultSpec = list.default || '';
  } catch (error) {
    keys.replaceChildren(el('p', { class: 'error' }, `The policy list is unavailable: ${error.message}`));
  }
  if (!page.alive()) return null;
  const defaultName = policyName(defaultSpec);
  if (!policies.length) policy.append(el('option', { value: '' }, 'the daemon default'));
  for (const p of policies) {
    policy.append(el('option', { value: p.name, selected: p.name === defaultName },
      p.name === defaultName ? `${p.name} (default)` : p.name));
  }
  if (policies.length) showKeys();
  policy.addEventListener('change', showKeys);

  const poll = async (jobId, show) => {
    try {
      const job = await api.getJob(jobId);
      if (!page.alive()) return;
      show(job);
      if (job.state === 'done' || job.state === 'failed') {
        submit.disabled = false;
        return;
      }
    } catch (error) {
      if (!page.alive()) return;
      if (error.status === 404) {
        show({ id: jobId, state: 'failed', error: `the daemon forgot job ${jobId} (${error.message})` });
        submit.disabled = false;
        return;
      }
    }
    timer = setTimeout(() => poll(jobId, show), POLL_MS);
  };

  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    formError.hidden = true;
    let body;
    try {
      body = registrationBody({ mode, text, policy, retention, quality, namespace, pin }, defaultSpec);
    } catch (error) {
      formError.textContent = error.message;
      formError.hidden = false;
      return;
    }
    stop();
    submit.disabled = true;
    const { panel, show } = jobPanel();
    jobArea.replaceChildren(panel);
    try {
      const answer = await api.register(body);
      if (!page.alive()) return;
      show(answer);
      if (answer.state === 'done' || answer.state === 'failed') submit.disabled = false;
      else poll(answer.job_id ?? answer.id, show);
    } catch (error) {
      show({ state: 'failed', error: error.message });
      submit.disabled = false;
    }
  });
  markReady(main);
  return stop;
}
