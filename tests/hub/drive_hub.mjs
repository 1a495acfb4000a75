// Drives Debian's Chromium through a JupyterHub for tests/hub/test_hub_panel.py: a user logs
// in with the Hub's login form, lands in the JupyterLab of the server the Hub started for
// them, and uses the Llama panel, whose llama/ routes relay to the shared manager.
//
// playwright-core is tests/ui's (tests/ui/node_modules), imported by its path: the browser
// tests share one copy of it.
//
// Environment: HUB_URL (ends with /), HUB_USER (the user who logs in), ARTIFACTS (a folder),
// CHROMIUM, PROFILE (a fresh user-data dir), SHARED_MODEL (a model another user loaded, as ps
// names it), LOAD_MODEL (a registered model nobody has loaded: the panel loads it),
// PRIVATE_MODEL (another user's own model: never in this user's panel), OTHER_USER (who
// loaded SHARED_MODEL and owns PRIVATE_MODEL).
//
// Protocol with the Python test, as tests/ui/drive.mjs: every line this prints is a log line,
// except "CALL <json>": the test performs the call (the service's REST API as another user)
// and answers one line on stdin, "OK" or "ERR <message>". Exits 0 when every check passed;
// a failure prints "FAIL <message>" and exits 1.
import { chromium } from '../ui/node_modules/playwright-core/index.mjs';
import { createInterface } from 'node:readline';
import path from 'node:path';

const hub = process.env.HUB_URL;
const user = process.env.HUB_USER || 'alice';
const otherUser = process.env.OTHER_USER || 'bob';
const artifacts = process.env.ARTIFACTS;
const shared = process.env.SHARED_MODEL || 'tiny:latest';
const toLoad = process.env.LOAD_MODEL || 'other:latest';
const privateModel = process.env.PRIVATE_MODEL || 'bob/mine:latest';

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

function log(msg) {
  process.stdout.write(`STEP ${msg}\n`);
}

/** Ask the Python side to do something (the service's REST API, as another user). */
async function call(what) {
  process.stdout.write(`CALL ${JSON.stringify(what)}\n`);
  const line = answers.length ? answers.shift() : await new Promise(r => (waiting = r));
  if (line !== 'OK') {
    throw new Error(`the test's ${what.op} failed: ${line}`);
  }
}

const panel = '#jupyter-llama-panel';
const card = name => `${panel} .jp-Llama-card[data-loaded-model="${name}"]`;
const row = name => `${panel} .jp-Llama-model[data-model="${name}"]`;

async function main() {
  const context = await chromium.launchPersistentContext(process.env.PROFILE, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    viewport: { width: 1360, height: 860 },
    args: [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync'
    ]
  });
  try {
    const page = context.pages()[0] ?? (await context.newPage());
    page.setDefaultTimeout(45000);
    const pageErrors = [];
    page.on('pageerror', e => pageErrors.push(String(e).slice(0, 400)));
    page.on('console', m => {
      if (m.type() === 'error' && /llama/i.test(m.text())) {
        pageErrors.push(m.text().slice(0, 400));
      }
    });
    // every llama/ request the page makes, with its answer's status: they must go to this
    // user's own server (its relay), never to the service directly
    const llamaRequests = [];
    page.on('response', r => {
      const p = new URL(r.url()).pathname;
      if (/\/llama\//.test(p)) {
        llamaRequests.push({ path: p, status: r.status() });
      }
    });
    const checkErrors = () => {
      if (pageErrors.length) {
        throw new Error(`errors in the page: ${pageErrors.slice(0, 3).join(' | ')}`);
      }
    };

    log(`open ${user}'s server at the Hub: the Hub asks who it is`);
    await page.goto(`${hub}user/${user}/`);
    await page.locator('input[name="username"]').waitFor();
    await page.locator('input[name="username"]').fill(user);
    await page.locator('input[name="password"]').fill('any password (the dummy authenticator takes it)');
    await Promise.all([page.waitForURL(/\/lab(\?|\/|$)/, { timeout: 90000 }), page.locator('#login_submit').click()]);
    const landed = new URL(page.url()).pathname;
    if (!landed.startsWith(`/user/${user}/lab`)) {
      throw new Error(`after the login the browser is at ${landed}, not ${user}'s JupyterLab`);
    }
    await page.waitForSelector('#jupyterlab-splash', { state: 'detached', timeout: 90000 });
    log(`logged in: JupyterLab at ${landed}`);

    log(`the status bar counts the model ${otherUser} loaded`);
    const status = page.locator('.jp-Llama-statusItem');
    await status.filter({ hasText: 'Llama: 1 model' }).waitFor({ timeout: 30000 });
    checkErrors();

    log(`the panel shows ${shared}, loaded by ${otherUser}, with its memory card`);
    await status.click();
    await page.locator(panel).waitFor({ state: 'visible' });
    await page.locator(`${card(shared)}[data-state="ready"]`).waitFor();
    await page.locator(`${card(shared)} .jp-Llama-memory .jp-Llama-fill-actual`).first().waitFor();
    await page.locator(`${row(shared)}[data-loaded="true"]`).waitFor();
    await page.locator(`${row(toLoad)}[data-loaded="false"] button[data-action="load"]`).waitFor();

    log(`${otherUser}'s own model ${privateModel} is not in the list`);
    const listed = await page.locator(`${panel} .jp-Llama-model`).evaluateAll(els => els.map(el => el.dataset.model));
    if (listed.includes(privateModel) || !listed.includes(shared) || !listed.includes(toLoad)) {
      throw new Error(`the registered models ${user} sees: ${JSON.stringify(listed)}`);
    }

    log(`load ${toLoad} with the panel's Load button`);
    await page.locator(`${row(toLoad)} button[data-action="load"]`).click();
    await page.locator(`${card(toLoad)}[data-state="ready"]`).waitFor({ timeout: 90000 });
    await page.locator(`${card(toLoad)} .jp-Llama-memory[data-device="cpu"] .jp-Llama-fill-actual`).first().waitFor();
    await page.locator(`${row(toLoad)}[data-loaded="true"]`).waitFor();
    await status.filter({ hasText: 'Llama: 2 models' }).waitFor();
    const cardText = await page.locator(card(toLoad)).innerText();
    for (const word of ['GPU layers', 'context', 'in flight', 'unloads in', 'actual']) {
      if (!cardText.includes(word)) {
        throw new Error(`the card of ${toLoad} lacks "${word}": ${cardText}`);
      }
    }
    const width = await page
      .locator(`${card(toLoad)} .jp-Llama-fill-actual`)
      .first()
      .evaluate(el => el.getBoundingClientRect().width);
    if (!(width > 2)) {
      throw new Error(`the actual-memory bar of ${toLoad} is ${width}px wide`);
    }
    await call({ op: 'check_loaded_by_user' });

    log(`${user} may not unload ${shared} (${otherUser}'s load): the refusal is a notification, the card stays`);
    await page.locator(`${card(shared)} button[data-action="unload"]`).click();
    const refusal = page.locator('.Toastify__toast', { hasText: `Unload of ${shared} failed` }).first();
    await refusal.waitFor({ timeout: 30000 });
    const refusalText = await refusal.innerText();
    if (!refusalText.includes("another user's request loaded it")) {
      throw new Error(`the refusal does not say why: ${refusalText}`);
    }
    await refusal.locator('.jp-Notification-Toast-Close').click();
    await refusal.waitFor({ state: 'detached' });
    await page.locator(`${card(shared)}[data-state="ready"]`).waitFor();

    log(`after a refresh, ${user}'s panel shows the two models and nothing of ${otherUser}'s own`);
    await page.locator(`${panel} button[aria-label="refresh"]`).click();
    await page.waitForTimeout(600);
    const panelText = await page.locator(panel).innerText();
    const cards = await page.locator(`${panel} .jp-Llama-card`).evaluateAll(els => els.map(el => el.dataset.loadedModel));
    if (panelText.includes(privateModel.split(':')[0]) || panelText.includes(otherUser)) {
      throw new Error(`${user}'s panel names ${otherUser} or his own model ${privateModel}: ${panelText}`);
    }
    if (JSON.stringify([...cards].sort()) !== JSON.stringify([shared, toLoad].sort())) {
      throw new Error(`the loaded models in ${user}'s panel: ${JSON.stringify(cards)}`);
    }

    const direct = llamaRequests.filter(r => !r.path.startsWith(`/user/${user}/llama/`));
    if (direct.length) {
      throw new Error(`the page asked something other than its server's llama/ routes: ${JSON.stringify(direct.slice(0, 3))}`);
    }
    const failed = llamaRequests.filter(r => r.status >= 400 && !/\/api\/generate$/.test(r.path));
    if (failed.length) {
      throw new Error(`llama/ requests that failed: ${JSON.stringify(failed.slice(0, 3))}`);
    }
    log(`${llamaRequests.length} llama/ requests, all through /user/${user}/llama/`);

    await page.waitForTimeout(600);
    await page.screenshot({ path: path.join(artifacts, 'hub-panel.png') });
    log('screenshot hub-panel.png');
    checkErrors();
    log('done');
  } catch (e) {
    const page = context.pages()[0];
    if (page) {
      await page.screenshot({ path: path.join(artifacts, 'hub-panel-failure.png') }).catch(() => undefined);
    }
    throw e;
  } finally {
    await context.close();
  }
}

main().then(
  () => process.exit(0),
  e => {
    process.stdout.write(`FAIL ${String(e && e.stack ? e.stack : e).replace(/\n/g, ' | ')}\n`);
    process.exit(1);
  }
);
