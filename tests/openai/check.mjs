// The official `openai` client, unmodified, against a running prefixd:
//   node check.mjs PORT [ALIAS]
// ALIAS: a second name in server.model_names that models.retrieve must find.
// The model must have a chat template (test_daemon.c serves a generated
// model carrying the Phi-3 vocabulary). Exits 0 when every check passes;
// otherwise prints what differed and exits 1.
import OpenAI from 'openai';

const port = process.argv[2];
if (!port) {
  console.error('usage: node check.mjs PORT [ALIAS]');
  process.exit(2);
}
const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: 'x', maxRetries: 0, timeout: 120000 });

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

const models = await client.models.list();
check(models.data.length === 1 && models.data[0].object === 'model', `models.list: ${JSON.stringify(models.data)}`);
const model = models.data[0].id;

// models.retrieve: the listed id, a second served name that holds a '/'
// (the client percent-encodes it into the path), and a typed 404.
const alias = process.argv[3];
const m = await client.models.retrieve(model);
check(m.id === model && m.object === 'model' && m.owned_by === 'prefixd', `models.retrieve: ${JSON.stringify(m)}`);
check(m.created === models.data[0].created, `models.retrieve created ${m.created}`);
if (alias) {
  const a = await client.models.retrieve(alias);
  check(a.id === alias && a.object === 'model', `models.retrieve(${alias}): ${JSON.stringify(a)}`);
}
let notFound = null;
try {
  await client.models.retrieve('no-such-model');
} catch (e) {
  notFound = e;
}
check(notFound instanceof OpenAI.NotFoundError && notFound.status === 404, `models.retrieve 404: ${notFound}`);
check(notFound.code === 'model_not_found', `models.retrieve 404 code: ${JSON.stringify(notFound.error)}`);

// Completions: non-streamed, then streamed with the same seed.
const creq = { model, prompt: 'Once upon a time', max_tokens: 12, temperature: 1, seed: 3 };
const c = await client.completions.create(creq);
check(c.object === 'text_completion', `completion object: ${c.object}`);
check(c.choices.length === 1 && typeof c.choices[0].text === 'string', 'completion choice');
check(c.usage.completion_tokens >= 1 && c.usage.completion_tokens <= 12, `completion usage ${JSON.stringify(c.usage)}`);
let streamed = '';
let finish = null;
for await (const chunk of await client.completions.create({ ...creq, stream: true })) {
  for (const ch of chunk.choices) {
    streamed += ch.text ?? '';
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
check(streamed === c.choices[0].text, `streamed completion ${JSON.stringify(streamed)} != ${JSON.stringify(c.choices[0].text)}`);
check(finish === c.choices[0].finish_reason, `completion finish_reason ${finish}`);

// Chat: non-streamed, then streamed (with usage) with the same seed.
const messages = [
  { role: 'system', content: 'You are a helpful assistant.' },
  { role: 'user', content: 'Tell me a story.' },
];
const qreq = { model, messages, max_tokens: 12, temperature: 1, seed: 5 };
const q = await client.chat.completions.create(qreq);
check(q.object === 'chat.completion', `chat object: ${q.object}`);
check(q.choices[0].message.role === 'assistant', `chat role ${q.choices[0].message.role}`);
check(typeof q.choices[0].message.content === 'string', 'chat content');
check(q.usage.prompt_tokens > 0 && q.usage.completion_tokens >= 1, `chat usage ${JSON.stringify(q.usage)}`);
let text = '';
let role = null;
let usage = null;
for await (const chunk of await client.chat.completions.create({
  ...qreq,
  stream: true,
  stream_options: { include_usage: true },
})) {
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    if (ch.delta.role) role = ch.delta.role;
    text += ch.delta.content ?? '';
  }
}
check(role === 'assistant', `streamed chat role ${role}`);
check(text === q.choices[0].message.content, `streamed chat ${JSON.stringify(text)} != ${JSON.stringify(q.choices[0].message.content)}`);
check(usage && usage.completion_tokens === q.usage.completion_tokens, `streamed chat usage ${JSON.stringify(usage)}`);

// Role developer (the newer name for system): the same prompt, so the same
// answer with the same seed.
const dev = await client.chat.completions.create({
  ...qreq,
  messages: [{ role: 'developer', content: messages[0].content }, messages[1]],
});
check(dev.usage.prompt_tokens === q.usage.prompt_tokens, `developer prompt_tokens ${dev.usage.prompt_tokens} != ${q.usage.prompt_tokens}`);
check(dev.choices[0].message.content === q.choices[0].message.content,
  `developer chat ${JSON.stringify(dev.choices[0].message.content)} != ${JSON.stringify(q.choices[0].message.content)}`);
// The automatic prefix cache: the same long chat again reports cached
// tokens (usage.prompt_tokens_details) with the same greedy answer.
const longSystem = 'You are a patient storyteller. '.repeat(12);
const areq = {
  model,
  messages: [
    { role: 'system', content: longSystem },
    { role: 'user', content: 'Tell me a story about a dog.' },
  ],
  max_tokens: 8,
  temperature: 0,
};
const a1 = await client.chat.completions.create(areq);
const a2 = await client.chat.completions.create(areq);
const cached = a2.usage.prompt_tokens_details?.cached_tokens ?? 0;
check(cached >= 16 && cached < a2.usage.prompt_tokens, `repeated chat cached_tokens ${JSON.stringify(a2.usage)}`);
check(a2.prefix?.kind === 'auto', `repeated chat prefix ${JSON.stringify(a2.prefix)}`);
check(a2.choices[0].message.content === a1.choices[0].message.content, 'the cache changed a greedy answer');

// An invalid request surfaces as the client's typed error with the status.
let err = null;
try {
  await client.completions.create({ model, prompt: 'Hi', temperature: 9 });
} catch (e) {
  err = e;
}
check(err instanceof OpenAI.BadRequestError && err.status === 400, `bad request: ${err}`);
check(err.error?.param === 'temperature' || err.param === 'temperature', `error param: ${JSON.stringify(err.error)}`);

console.log('openai client checks passed');
