// The line protocol between a browser driver (tests/ui/drive.mjs, tests/hub/drive_hub.mjs)
// and the Python test that runs it: every line the driver prints is a log line ("STEP ..."),
// except "CALL <json>": the test performs the call (a REST request from outside the
// browser) and answers one line on stdin, "OK" or "ERR <message>".
import { createInterface } from 'node:readline';

const stdin = createInterface({ input: process.stdin });
const answers = [];
let waiting = null;
stdin.on('line', line => {
  if (waiting) {
    const w = waiting;
    waiting = null;
    w(line);
  } else {
    answers.push(line);
  }
});

/** Say what the driver does now (the test prints it with its own log). */
export function log(msg) {
  process.stdout.write(`STEP ${msg}\n`);
}

/** Ask the Python side to do something; an error naming it unless it answers OK. */
export async function call(what) {
  process.stdout.write(`CALL ${JSON.stringify(what)}\n`);
  const line = answers.length ? answers.shift() : await new Promise(r => (waiting = r));
  if (line !== 'OK') {
    throw new Error(`the test's ${what.op} failed: ${line}`);
  }
}
