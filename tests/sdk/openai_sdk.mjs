// agentloop's OpenAI-compatible endpoints driven by the official `openai` npm package.
// Env: AGENTLOOP_BASE (http://host:port/v1), AGENTLOOP_KEY. Exits non-zero on the first failed
// check; prints "N passed, 0 failed" at the end.
import OpenAI from 'openai';

const base = process.env.AGENTLOOP_BASE;
const client = new OpenAI({ baseURL: base, apiKey: process.env.AGENTLOOP_KEY, maxRetries: 0, timeout: 60_000 });
let passed = 0;
function check(name, cond, detail) {
  if (!cond) {
    console.error(`FAILED ${name}: ${typeof detail === 'string' ? detail : JSON.stringify(detail)}`);
    process.exit(1);
  }
  passed++;
}
const script = (steps) => 'MOCK: ' + JSON.stringify({ steps });
const user = (content) => [{ role: 'user', content }];

const models = await client.models.list();
check('models.list', models.data.map((m) => m.id).join() === 'mock', models.data);

const r = await client.chat.completions.create({ model: 'mock', messages: user('What is 6*7?') });
check('non-stream', r.choices[0].message.content === 'The result is 42.' && r.choices[0].finish_reason === 'stop', r);
check('non-stream usage', r.usage.prompt_tokens > 0 && r.usage.completion_tokens > 0, r.usage);

const stream = await client.chat.completions.create({
  model: 'mock',
  messages: user(script([{ text: 'alpha beta gamma delta epsilon zeta eta theta iota kappa', chunkDelayMs: 150 }])),
  stream: true,
  stream_options: { include_usage: true },
});
const chunks = [];
for await (const chunk of stream) chunks.push(chunk);
const text = chunks.filter((c) => c.choices.length).map((c) => c.choices[0].delta.content ?? '').join('');
check('stream text', text === 'alpha beta gamma delta epsilon zeta eta theta iota kappa', text);
check('stream pieces', chunks.filter((c) => c.choices.length && c.choices[0].delta.content).length > 1, chunks.length);
check('stream finish', chunks.filter((c) => c.choices.length && c.choices[0].finish_reason).map((c) => c.choices[0].finish_reason).join() === 'stop');
const last = chunks[chunks.length - 1];
check('stream usage', last.choices.length === 0 && last.usage.total_tokens > 0, last);

// The SDK's own stream helper accumulates the final message.
const runner = client.chat.completions.stream({ model: 'mock', messages: user('What is 9*9?') });
const final = await runner.finalChatCompletion();
check('stream helper', final.choices[0].message.content === 'The result is 81.', final);

const tools = [{ type: 'function', function: { name: 'lookup', parameters: { type: 'object', properties: { q: { type: 'string' } } } } }];
const messages = user(script([{ toolCalls: [{ name: 'lookup', arguments: { q: 'agentloop' } }] }, { text: 'Found: {{tool_result}}' }]));
const r1 = await client.chat.completions.create({ model: 'mock', messages, tools });
check('client tool', r1.choices[0].finish_reason === 'tool_calls' && r1.choices[0].message.tool_calls[0].function.name === 'lookup', r1);
const call = r1.choices[0].message.tool_calls[0];
check('client tool args', JSON.parse(call.function.arguments).q === 'agentloop', call);
messages.push(r1.choices[0].message, { role: 'tool', tool_call_id: call.id, content: 'a durable agent server' });
const r2 = await client.chat.completions.create({ model: 'mock', messages, tools });
check('client tool round trip', r2.choices[0].message.content === 'Found: a durable agent server', r2);

async function expect(cls, fn, code, param) {
  try {
    await fn();
  } catch (e) {
    check(`${cls.name} ${code}`, e instanceof cls && e.code === code && (param === undefined || e.param === param), { name: e.constructor.name, status: e.status, code: e.code, param: e.param, error: e.error });
    return;
  }
  check(`${cls.name} ${code} thrown`, false, 'no error');
}
await expect(OpenAI.BadRequestError, () => client.chat.completions.create({ model: 'mock', messages: [{ role: 'wizard', content: 'x' }] }), 'invalid_messages', 'messages[0].role');
await expect(OpenAI.NotFoundError, () => client.chat.completions.create({ model: 'nope', messages: user('x') }), 'model_not_found', 'model');
await expect(OpenAI.InternalServerError, () => client.chat.completions.create({ model: 'mock', messages: user(script([{ status: 400 }])) }), 'model_http_error');
await expect(OpenAI.APIError, async () => {
  for await (const _ of await client.chat.completions.create({ model: 'mock', messages: user(script([{ status: 400 }])), stream: true })) { /* drain */ }
}, 'model_http_error');
const bad = new OpenAI({ baseURL: base, apiKey: 'al_0000000000000000000000000000000000000000', maxRetries: 0 });
await expect(OpenAI.AuthenticationError, () => bad.chat.completions.create({ model: 'mock', messages: user('x') }), 'invalid_api_key');

console.log(`${passed} passed, 0 failed`);
