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
import { call, log } from '../ui/protocol.mjs';
import path from 'node:path';

const hub = process.env.HUB_URL;
const user = process.env.HUB_USER || 'alice';
const otherUser = process.env.OTHER_USER || 'bob';
const artifacts = process.env.ARTIFACTS;
const shared = process.env.SHARED_MODEL || 'tiny:latest';
const toLoad = process.env.LOAD_MODEL || 'other:latest';
const privateModel = process.env.PRIVATE_MODEL || 'bob/mine:latest';

const panel = '#jupyter-llama-panel';
const card = name => `${panel} .jp-Llama-card[data-loaded-model="${name}"]`;
const row = name => `${panel} .jp-Llama-model[data-model="${name}"]`;
const REFUSAL = "another user's request loaded it; only they or an admin can unload it";

/** The line of a loaded model's card that says who holds it comes to read ``text``. */
async function peopleLine(page, name, text) {
  const line = page.locator(`${card(name)} .jp-Llama-people`);
  const deadline = Date.now() + 20000;
  let now = '';
  while (Date.now() < deadline) {
    now = (await line.count()) ? (await line.innerText()).trim() : '(no such line)';
    if (now === text) {
      return;
    }
    await page.waitForTimeout(200);
  }
  throw new Error(`the card of ${name} says who holds it as "${now}", not "${text}"`);
}

/** Both Unload buttons of ``name`` (its card's, its registered row's) are off, saying why. */
async function unloadIsOff(page, name) {
  for (const where of [card(name), row(name)]) {
    const button = page.locator(`${where} button[data-action="unload"]`);
    if (!(await button.isDisabled())) {
      throw new Error(`the Unload button of ${name} (${where}) is on: the service would refuse it`);
    }
    const title = (await button.getAttribute('title')) ?? '';
    if (!title.includes(REFUSAL)) {
      throw new Error(`the Unload button of ${name} does not say why it is off: "${title}"`);
    }
  }
}

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

    log(`its card says another user loaded it, and its Unload buttons are off, saying why`);
    await peopleLine(page, shared, 'loaded by another user');
    await unloadIsOff(page, shared);

    log(`${user} uses ${shared} (her own request, as her kernel would): the card counts her and the other`);
    await call({ op: 'use_shared_as_user' });
    await page.locator(`${panel} button[aria-label="refresh"]`).click();
    await peopleLine(page, shared, 'loaded by another user · used by you and 1 other');
    await unloadIsOff(page, shared);

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
    log(`the card of ${toLoad} says ${user} loaded it, and its Unload button is on`);
    await peopleLine(page, toLoad, 'loaded by you');
    if (await page.locator(`${card(toLoad)} button[data-action="unload"]`).isDisabled()) {
      throw new Error(`the Unload button of ${toLoad}, which ${user} loaded, is off`);
    }
    await page.locator(`${card(shared)}[data-state="ready"]`).waitFor();
    await unloadIsOff(page, shared);

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
    // nothing refused: the panel offered no Unload the service would refuse
    const failed = llamaRequests.filter(r => r.status >= 400);
    if (failed.length) {
      throw new Error(`llama/ requests that failed: ${JSON.stringify(failed.slice(0, 3))}`);
    }
    if (!llamaRequests.some(r => r.path === `/user/${user}/llama/api/me` && r.status === 200)) {
      throw new Error(`the panel never asked api/me whether ${user} administers the service`);
    }
    if (await page.locator('.Toastify__toast', { hasText: 'failed' }).count()) {
      throw new Error(`a failure notification: ${await page.locator('.Toastify__toast').first().innerText()}`);
    }
    log(`${llamaRequests.length} llama/ requests, all through /user/${user}/llama/`);

    await page.waitForTimeout(600);
    await page.screenshot({ path: path.join(artifacts, 'hub-panel.png') });
    log('screenshot hub-panel.png');

    log(`${user} unloads ${toLoad}, which her request loaded, with its card's Unload button`);
    await page.locator(`${card(toLoad)} button[data-action="unload"]`).click();
    await page.locator(card(toLoad)).waitFor({ state: 'detached', timeout: 30000 });
    await call({ op: 'check_unloaded' });
    await page.locator(`${card(shared)}[data-state="ready"]`).waitFor();
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
