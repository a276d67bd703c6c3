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

// ---- Structured output. The model has random weights, so whatever it would
// say, the grammar alone makes the answer valid: over many seeds, JSON mode
// always parses and a JSON-schema answer always validates.
for (let seed = 0; seed < 12; seed++) {
  const r = await client.chat.completions.create({ model, messages, max_tokens: 48, temperature: 1, seed,
    response_format: { type: 'json_object' } });
  const text = r.choices[0].message.content;
  let doc;
  try { doc = JSON.parse(text); } catch (e) { check(false, `json_object seed ${seed}: not JSON: ${JSON.stringify(text)}`); }
  check(doc !== null && typeof doc === 'object' && !Array.isArray(doc), `json_object seed ${seed}: not an object: ${text}`);
  check(r.choices[0].finish_reason === 'stop', `json_object seed ${seed}: finish ${r.choices[0].finish_reason}`);
}
const personSchema = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 12 },
    age: { type: 'integer' },
    tags: { type: 'array', items: { enum: ['red', 'green', 'blue'] }, maxItems: 3 },
    ok: { type: 'boolean' },
    note: { anyOf: [{ type: 'null' }, { const: 'fine' }] },
  },
  required: ['name', 'age', 'tags', 'ok'],
  additionalProperties: false,
};
function checkPerson(doc, what) {
  check(doc !== null && typeof doc === 'object' && !Array.isArray(doc), `${what}: not an object`);
  for (const k of Object.keys(doc)) check(k in personSchema.properties, `${what}: extra key ${k}`);
  check(typeof doc.name === 'string' && [...doc.name].length <= 12, `${what}: name ${JSON.stringify(doc.name)}`);
  check(Number.isInteger(doc.age), `${what}: age ${doc.age}`);
  check(Array.isArray(doc.tags) && doc.tags.length <= 3 && doc.tags.every((t) => ['red', 'green', 'blue'].includes(t)),
    `${what}: tags ${JSON.stringify(doc.tags)}`);
  check(typeof doc.ok === 'boolean', `${what}: ok ${doc.ok}`);
  check(!('note' in doc) || doc.note === null || doc.note === 'fine', `${what}: note ${doc.note}`);
}
for (let seed = 0; seed < 12; seed++) {
  const rf = { type: 'json_schema', json_schema: { name: 'person', schema: personSchema, strict: true } };
  const r = await client.chat.completions.create({ model, messages, max_tokens: 80, temperature: 1, seed, response_format: rf });
  const text = r.choices[0].message.content;
  let doc;
  try { doc = JSON.parse(text); } catch (e) { check(false, `json_schema seed ${seed}: not JSON: ${JSON.stringify(text)}`); }
  checkPerson(doc, `json_schema seed ${seed}`);
  // the same on /v1/completions, and streamed (the deltas join to the same document)
  const c = await client.completions.create({ model, prompt: 'A person:', max_tokens: 80, temperature: 1, seed, response_format: rf });
  checkPerson(JSON.parse(c.choices[0].text), `completions json_schema seed ${seed}`);
  let streamedDoc = '';
  for await (const chunk of await client.chat.completions.create({ model, messages, max_tokens: 80, temperature: 1, seed,
    response_format: rf, stream: true })) {
    for (const ch of chunk.choices) streamedDoc += ch.delta.content ?? '';
  }
  check(streamedDoc === text, `streamed json_schema seed ${seed}: ${JSON.stringify(streamedDoc)} != ${JSON.stringify(text)}`);
}
// A keyword the grammar cannot enforce is a 400 naming it, never ignored.
let schemaErr = null;
try {
  await client.chat.completions.create({ model, messages, max_tokens: 8, response_format: { type: 'json_schema',
    json_schema: { name: 'n', schema: { type: 'integer', multipleOf: 3 } } } });
} catch (e) {
  schemaErr = e;
}
check(schemaErr instanceof OpenAI.BadRequestError && /multipleOf/.test(schemaErr.message), `unsupported keyword: ${schemaErr}`);

// ---- Tool calls, for each tool_choice, plain and streamed.
const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 16 }, unit: { enum: ['c', 'f'] } },
      required: ['city', 'unit'], additionalProperties: false } } },
  { type: 'function', function: { name: 'get_time', description: 'The time now',
    parameters: { type: 'object', properties: {}, additionalProperties: false } } },
];
function checkCall(call, what) {
  check(call.type === 'function' && typeof call.id === 'string' && call.id.length > 0, `${what}: call ${JSON.stringify(call)}`);
  const args = JSON.parse(call.function.arguments);
  if (call.function.name === 'get_weather') {
    check(typeof args.city === 'string' && ['c', 'f'].includes(args.unit) && Object.keys(args).length === 2,
      `${what}: get_weather args ${call.function.arguments}`);
  } else {
    check(call.function.name === 'get_time' && Object.keys(args).length === 0, `${what}: call ${JSON.stringify(call)}`);
  }
}
async function streamedTurn(req) {
  const calls = [];
  let content = '';
  let finish = null;
  for await (const chunk of await client.chat.completions.create({ ...req, stream: true })) {
    for (const ch of chunk.choices) {
      content += ch.delta.content ?? '';
      for (const tc of ch.delta.tool_calls ?? []) {
        calls[tc.index] ??= { id: '', type: 'function', function: { name: '', arguments: '' } };
        const c = calls[tc.index];
        if (tc.id) c.id = tc.id;
        if (tc.function?.name) c.function.name += tc.function.name;
        if (tc.function?.arguments) c.function.arguments += tc.function.arguments;
      }
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  return { calls, content, finish };
}
const toolMessages = [{ role: 'system', content: 'You can look things up.' }, { role: 'user', content: 'Weather in Paris?' }];
const choices = ['required', { type: 'function', function: { name: 'get_time' } }, 'auto', 'none'];
let sawAutoCall = false, sawAutoText = false, firstCall = null, firstReq = null, firstUsage = null;
for (const tool_choice of choices) {
  for (let seed = 0; seed < 6; seed++) {
    const req = { model, messages: toolMessages, tools, tool_choice, max_tokens: 64, temperature: 1, seed };
    const what = `tool_choice ${JSON.stringify(tool_choice)} seed ${seed}`;
    const r = await client.chat.completions.create(req);
    const m = r.choices[0].message, fin = r.choices[0].finish_reason;
    const s = await streamedTurn(req);
    if (tool_choice === 'none') {
      check(!m.tool_calls && typeof m.content === 'string' && fin !== 'tool_calls', `${what}: ${JSON.stringify(r.choices[0])}`);
    } else if (tool_choice === 'auto' && !m.tool_calls) {
      sawAutoText = true;
      check(typeof m.content === 'string' && !m.content.startsWith('<tool_call>'), `${what}: ${JSON.stringify(m)}`);
    } else {
      if (tool_choice === 'auto') sawAutoCall = true;
      check(fin === 'tool_calls' && m.content === null && m.tool_calls.length >= 1, `${what}: ${JSON.stringify(r.choices[0])}`);
      m.tool_calls.forEach((c) => checkCall(c, what));
      if (typeof tool_choice === 'object') check(m.tool_calls.length === 1 && m.tool_calls[0].function.name === 'get_time', `${what}: named`);
      check(s.finish === 'tool_calls' && s.calls.length === m.tool_calls.length, `${what}: streamed ${JSON.stringify(s)}`);
      s.calls.forEach((c, i) => check(c.function.name === m.tool_calls[i].function.name &&
        c.function.arguments === m.tool_calls[i].function.arguments, `${what}: streamed call ${i} ${JSON.stringify(c)}`));
      if (!firstCall && tool_choice === 'required') {
        firstCall = m;
        firstReq = req;
        firstUsage = r.usage;
      }
    }
    if (!m.tool_calls) check(s.content === m.content && s.calls.length === 0 && s.finish === fin, `${what}: streamed text ${JSON.stringify(s)}`);
  }
}
check(sawAutoCall || sawAutoText, 'tool_choice auto answered');
// The call goes back with its result (role tool), and the conversation goes on.
const back = await client.chat.completions.create({ ...firstReq, tool_choice: 'auto', messages: [...toolMessages,
  { role: 'assistant', content: null, tool_calls: firstCall.tool_calls },
  ...firstCall.tool_calls.map((c) => ({ role: 'tool', tool_call_id: c.id, content: '{"temperature": 21}' }))] });
check(back.usage.prompt_tokens > firstUsage.prompt_tokens + 8, `tool round trip: ${JSON.stringify(back.usage)} vs ${JSON.stringify(firstUsage)}`);
check(['stop', 'length', 'tool_calls'].includes(back.choices[0].finish_reason), `tool round trip: ${JSON.stringify(back.choices[0])}`);

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
