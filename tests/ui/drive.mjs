// Drives Debian's Chromium through a running JupyterLab for tests/ui/test_lab_ui.py.
//
// Environment: LAB_URL (ends with /), LAB_TOKEN, ARTIFACTS (a folder), CHROMIUM, PROFILE
// (a fresh user-data dir), MODEL (the registered model's name as ps shows it), PRESET_MODEL
// (a second registered model, made from MODEL with the system message "You are Mario" and
// num_predict 3), WIDE_MODEL (a larger registered model), SLOW_URL (a GGUF a local server
// sends over seconds), MISSING_URL (an address on that server with nothing there).
//
// Protocol with the Python test: every line this prints is a log line, except
// "CALL <json>": the test performs the call (the REST API from outside the browser, with
// httpx) and answers one line on stdin, "OK" or "ERR <message>". Exits 0 when every check
// passed; any failure prints "FAIL <message>" and exits 1.
import { chromium } from 'playwright-core';
import { call, log } from './protocol.mjs';
import path from 'node:path';

const base = process.env.LAB_URL;
const token = process.env.LAB_TOKEN;
const artifacts = process.env.ARTIFACTS;
const model = process.env.MODEL || 'tiny:latest';
const presetModel = process.env.PRESET_MODEL || 'mario:latest';
const wideModel = process.env.WIDE_MODEL || 'wide:latest';
const slowUrl = process.env.SLOW_URL;
const missingUrl = process.env.MISSING_URL;
const liveWorker = process.env.LIVE_WORKER; // rpc:127.0.0.1:PORT of a running ggml-rpc-server
const deadWorker = process.env.DEAD_WORKER; // rpc:127.0.0.1:PORT where nothing listens

const panel = '#jupyter-llama-panel';
const card = `${panel} .jp-Llama-card[data-loaded-model="${model}"]`;
const row = `${panel} .jp-Llama-model[data-model="${model}"]`;
const presetRow = `${panel} .jp-Llama-model[data-model="${presetModel}"]`;
const wideCard = `${panel} .jp-Llama-card[data-loaded-model="${wideModel}"]`;

const UNITS = { B: 1, KiB: 1024, MiB: 1024 ** 2, GiB: 1024 ** 3 };

/** How often ``needle`` occurs in ``text``. */
function occurrences(text, needle) {
  return text.split(needle).length - 1;
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
    // the panel's api/show calls (issue 16: once per model and digest, never per poll)
    const showCalls = [];
    page.on('request', req => {
      if (req.method() === 'POST' && /\/llama\/api\/show$/.test(new URL(req.url()).pathname)) {
        showCalls.push(JSON.parse(req.postData() || '{}').model);
      }
    });
    page.on('console', m => {
      if (m.type() === 'error' && /llama/i.test(m.text())) {
        pageErrors.push(m.text().slice(0, 400));
      }
    });

    const checkErrors = () => {
      if (pageErrors.length) {
        throw new Error(`errors in the page: ${pageErrors.slice(0, 3).join(' | ')}`);
      }
    };

    log('open the lab with the notebook');
    await page.goto(`${base}lab/tree/panel.ipynb?token=${token}`);
    await page.waitForSelector('#jupyterlab-splash', { state: 'detached', timeout: 90000 });

    log('the status-bar item shows no model loaded');
    const status = page.locator('.jp-Llama-statusItem');
    await status.filter({ hasText: 'Llama: 0 models' }).waitFor();

    checkErrors();
    log('a click on the status-bar item opens the Llama panel');
    await status.click();
    await page.locator(panel).waitFor({ state: 'visible' });
    await page.locator(`${row} button[data-action="load"]`).waitFor();
    const rowText = await page.locator(row).innerText();
    for (const word of [model, 'F32', 'KiB']) {
      if (!rowText.includes(word)) {
        throw new Error(`the registered model's row lacks ${word}: ${rowText}`);
      }
    }

    log("issue 16: the preset model's row shows its preset under its facts, its Modelfile as the tooltip");
    const presetLine = page.locator(`${presetRow} .jp-Llama-preset`);
    await presetLine.waitFor();
    const presetText = await presetLine.innerText();
    for (const words of ['system: “You are Mario”', 'num_predict 3']) {
      if (!presetText.includes(words)) {
        throw new Error(`the preset line lacks ${words}: ${presetText}`);
      }
    }
    const presetTitle = (await presetLine.getAttribute('title')) ?? '';
    if (!presetTitle.includes('SYSTEM You are Mario') || !presetTitle.includes('PARAMETER num_predict 3')) {
      throw new Error(`the preset line's tooltip is not the Modelfile: ${presetTitle}`);
    }
    const presetFacts = await page.locator(presetRow).innerText();
    if (!presetFacts.includes('F32') || !presetFacts.includes('KiB')) {
      throw new Error(`the preset model's row lost its facts: ${presetFacts}`);
    }
    if ((await page.locator(`${row} .jp-Llama-preset`).count()) !== 0) {
      throw new Error(`the plain model's row shows a preset: ${await page.locator(row).innerText()}`);
    }
    await page.waitForTimeout(400);
    await page.locator(panel).screenshot({ path: path.join(artifacts, 'lab-panel-preset.png') });
    log(`preset line "${presetText}"; screenshot lab-panel-preset.png`);

    log('the devices section lists both RPC workers: one ready, one unreachable with the reason');
    const liveRow = `${panel} .jp-Llama-device[data-device="${liveWorker}"]`;
    const deadRow = `${panel} .jp-Llama-device[data-device="${deadWorker}"]`;
    await page.locator(`${liveRow}[data-state="ready"]`).waitFor();
    await page.locator(`${deadRow}[data-state="unreachable"]`).waitFor();
    const deadText = await page.locator(deadRow).innerText();
    if (!/unreachable: .*refused/i.test(deadText) || !deadText.includes('left out of placement')) {
      throw new Error(`the dead worker's row does not say why it is left out: ${deadText}`);
    }

    log("load the model with the panel's Load button");
    await page.locator(`${row} button[data-action="load"]`).click();
    await page.locator(`${card}[data-state="ready"]`).waitFor();
    await page.locator(`${card} .jp-Llama-memory[data-device="cpu"] .jp-Llama-fill-actual`).first().waitFor();
    await page.locator(`${card} [data-marker="detailed"]`).first().waitFor({ state: "attached" });
    await page.locator(`${row}[data-loaded="true"]`).waitFor();
    // the status bar renders from the same state as the panel, in the same update: no lag
    const statusWithPanel = await status.innerText();
    if (!statusWithPanel.includes('1 model')) {
      throw new Error(`the panel shows the model loaded, the status bar says "${statusWithPanel}"`);
    }
    // every marker in its estimator's legend colour, off-scale arrows too (a border shorthand
    // once turned those black)
    const markerColours = await page.locator(`${card} .jp-Llama-marker`).evaluateAll(els => els.map(el => {
      const cs = getComputedStyle(el);
      const probe = document.createElement('span');
      probe.style.color = `var(--jp-llama-${el.dataset.marker})`;
      el.parentElement.appendChild(probe);
      const legend = getComputedStyle(probe).color;
      probe.remove();
      const shown = el.classList.contains('jp-mod-offscale') ? cs.borderLeftColor : cs.backgroundColor;
      return { marker: el.dataset.marker, offscale: el.classList.contains('jp-mod-offscale'), shown, legend };
    }));
    for (const m of markerColours) {
      if (m.shown !== m.legend) {
        throw new Error(`the ${m.marker} marker${m.offscale ? ' (off scale)' : ''} is ${m.shown}, its legend ${m.legend}`);
      }
    }
    log(`markers in their legend colours: ${markerColours.map(m => m.marker + (m.offscale ? ' (off scale)' : '')).join(', ')}`);
    const width = await page
      .locator(`${card} .jp-Llama-fill-actual`)
      .first()
      .evaluate(el => el.getBoundingClientRect().width);
    if (!(width > 10)) {
      throw new Error(`the actual-memory bar is ${width}px wide`);
    }
    const cardText = await page.locator(card).innerText();
    if (!/context\s+\d+/.test(cardText)) {
      throw new Error(`no context size: ${cardText}`);
    }
    for (const word of ['GPU layers', 'in flight', 'unloads in', 'actual', 'predicted']) {
      if (!cardText.includes(word)) {
        throw new Error(`the loaded model's card lacks "${word}": ${cardText}`);
      }
    }
    await status.filter({ hasText: 'Llama: 1 model' }).waitFor();
    // the live worker now serves this model's llama-server, and says so
    await page.locator(`${liveRow}[data-state="held"]`, { hasText: `in use by ${model}` }).waitFor();
    await page.locator(`${panel} .jp-Llama-events li`, { hasText: 'loaded' }).first().waitFor();
    // the keep-alive countdown ticks in the page, between polls
    const countdown = page.locator(`${card} .jp-Llama-countdown`);
    const before = await countdown.innerText();
    await page.waitForFunction(
      ([sel, text]) => document.querySelector(sel)?.textContent !== text,
      [`${card} .jp-Llama-countdown`, before],
      { timeout: 5000 }
    );
    if (!/^unloads in \d+m \d\ds$/.test(await countdown.innerText())) {
      throw new Error(`odd countdown: ${await countdown.innerText()}`);
    }
    // let any transition finish, then the picture
    await page.waitForTimeout(600);
    await page.screenshot({ path: path.join(artifacts, 'lab-panel.png') });
    log(`memory bar ${Math.round(width)}px; screenshot lab-panel.png`);

    log("unload it with the card's Unload button");
    await page.locator(`${card} button[data-action="unload"]`).click();
    await page.locator(card).waitFor({ state: 'detached' });
    await page.locator(`${row}[data-loaded="false"]`).waitFor();
    const statusAfter = await status.innerText();  // at once, as the panel
    if (!statusAfter.includes('0 models')) {
      throw new Error(`the panel shows the model unloaded, the status bar says "${statusAfter}"`);
    }

    log('another client loads the model through the REST API: the panel shows it');
    await call({ op: 'load' });
    await page.locator(`${card}[data-state="ready"] .jp-Llama-fill-actual`).first().waitFor({ timeout: 20000 });
    await status.filter({ hasText: 'Llama: 1 model' }).waitFor({ timeout: 20000 });
    log('another client unloads it: the panel drops it');
    await call({ op: 'unload' });
    await page.locator(card).waitFor({ state: 'detached', timeout: 20000 });
    await status.filter({ hasText: 'Llama: 0 models' }).waitFor({ timeout: 20000 });

    log('issue 56: two models of different sizes loaded: their bars share one scale, which the panel states');
    await call({ op: 'load' });
    await call({ op: 'load_wide' });
    await page.locator(`${card}[data-state="ready"] .jp-Llama-fill-actual`).first().waitFor({ timeout: 20000 });
    await page.locator(`${wideCard}[data-state="ready"] .jp-Llama-fill-actual`).first().waitFor({ timeout: 20000 });
    const scaleLine = page.locator(`${panel} .jp-Llama-scale`);
    const scaleText = await scaleLine.innerText();
    if (!/^Memory bars share one scale, 0 to [\d.]+ (KiB|MiB|GiB): a bar's length is bytes\.$/.test(scaleText)) {
      throw new Error(`the panel does not say the bars' scale: "${scaleText}"`);
    }
    const scale = Number(await scaleLine.getAttribute('data-scale'));
    // every bar of both cards: its fill's share of the track is its actual bytes over the scale
    const bars = await page.locator(`${panel} .jp-Llama-card .jp-Llama-memory`).evaluateAll(els =>
      els.map(el => ({
        model: el.closest('.jp-Llama-card').dataset.loadedModel,
        device: el.dataset.device,
        track: el.querySelector('.jp-Llama-bar').getBoundingClientRect().width,
        fill: el.querySelector('.jp-Llama-bar-fill').getBoundingClientRect().width,
        text: el.querySelector('.jp-Llama-small').textContent
      }))
    );
    const lengths = [];
    for (const b of bars) {
      const m = /actual ([\d.]+) (B|KiB|MiB|GiB)/.exec(b.text);
      if (!m) {
        throw new Error(`a bar without its actual bytes: ${JSON.stringify(b)}`);
      }
      const bytes = Number(m[1]) * UNITS[m[2]];
      const expected = bytes / scale;
      const shown = b.fill / b.track;
      // (the words round to a tenth of a unit; the bar is drawn to the pixel)
      if (Math.abs(shown - expected) > 0.03 + 2 / b.track) {
        throw new Error(`${b.model} on ${b.device}: the bar is ${(100 * shown).toFixed(1)}% long, ` +
          `its ${m[1]} ${m[2]} are ${(100 * expected).toFixed(1)}% of the scale (${scaleText})`);
      }
      lengths.push(`${b.model} ${b.device} ${m[1]} ${m[2]}: ${(100 * shown).toFixed(1)}%`);
    }
    const tinyLongest = Math.max(...bars.filter(b => b.model === model).map(b => b.fill));
    const wideLongest = Math.max(...bars.filter(b => b.model === wideModel).map(b => b.fill));
    if (!(wideLongest > tinyLongest)) {
      throw new Error(`the larger model's bar is not the longer: ${lengths.join('; ')}`);
    }
    await page.waitForTimeout(400);
    await page.locator(`${panel} [data-section="loaded"]`).screenshot({ path: path.join(artifacts, 'lab-panel-scale.png') });
    log(`"${scaleText}" ${lengths.join('; ')}; screenshot lab-panel-scale.png`);
    await call({ op: 'unload' });
    await call({ op: 'unload_wide' });
    await page.locator(`${panel} .jp-Llama-card`).first().waitFor({ state: 'detached', timeout: 20000 });

    log('issue 56: a pull of a file the server does not have: one sentence that names the address once');
    const pullInput = page.locator(`${panel} input[aria-label="model to pull"]`);
    const pullText = page.locator(`${panel} .jp-Llama-pull-text`);
    const pullToast = page.locator('.Toastify__toast', { hasText: 'Pull of' }).first();
    await pullInput.fill(missingUrl);
    await page.locator(`${panel} button`, { hasText: 'Pull' }).click();
    await pullToast.waitFor({ timeout: 30000 });
    await page.locator(`${panel} .jp-Llama-pull-progress.jp-mod-error`).waitFor();
    const failText = await pullText.innerText();
    const toastText = await pullToast.innerText();
    if (occurrences(failText, missingUrl) !== 1 || !failText.includes('nothing is at this address (HTTP 404 not found).')) {
      throw new Error(`the failed pull's line: "${failText}"`);
    }
    if (occurrences(toastText, missingUrl) !== 1 || !toastText.includes('nothing is at this address')) {
      throw new Error(`the failed pull's notification: "${toastText}"`);
    }
    await page.waitForTimeout(300);
    await page.screenshot({ path: path.join(artifacts, 'lab-panel-404.png') });
    log(`"${failText}"; screenshot lab-panel-404.png`);
    // dismiss it (its close button), so it does not cover the next screenshot
    await pullToast.locator('.jp-Notification-Toast-Close').click();
    await page.locator('.Toastify__toast', { hasText: 'Pull of' }).waitFor({ state: 'detached' });
    await page.locator(`${panel} button[aria-label="clear the pull status"]`).click();
    await page.locator(`${panel} .jp-Llama-pull-progress`).waitFor({ state: 'hidden' });

    log('issue 56: a pull from a slow server shows its speed and the time left');
    await pullInput.fill(slowUrl);
    await page.locator(`${panel} input[aria-label="name for the pulled model"]`).fill('slow');
    await page.locator(`${panel} button`, { hasText: 'Pull' }).click();
    await page.waitForFunction(
      sel => /\d B\/s · about \d+[smhd]|[KMG]iB\/s · about \d+[smhd]/.test(document.querySelector(sel)?.textContent ?? ''),
      `${panel} .jp-Llama-pull-text`,
      { timeout: 30000 }
    );
    const progressText = await pullText.innerText();
    await page.locator(`${panel} .jp-Llama-pull-progress`).locator('..').screenshot({ path: path.join(artifacts, 'lab-panel-pull.png') });
    log(`"${progressText}"; screenshot lab-panel-pull.png`);
    await pullText.filter({ hasText: 'success' }).waitFor({ timeout: 60000 });
    const pulledToast = page.locator('.Toastify__toast', { hasText: 'Pulled' }).first();
    await pulledToast.locator('.jp-Notification-Toast-Close').click();
    await page.locator(`${panel} button[aria-label="clear the pull status"]`).click();
    await page.locator(`${panel} .jp-Llama-pull-progress`).waitFor({ state: 'hidden' });

    log('the commands are in the palette');
    await page.keyboard.press('Control+Shift+C');
    const search = page.locator('.lm-CommandPalette-input');
    await search.waitFor();
    await search.fill('Llama');
    for (const label of ['Open the Llama Panel', 'Load a Model…', 'Unload a Model…', 'Pull a Model…']) {
      await page.locator('.lm-CommandPalette-item', { hasText: label }).first().waitFor();
    }
    await page.keyboard.press('Escape');

    log('notebook: %load_ext jupyter_llama and %llama panel');
    const cell = page.locator('.jp-Notebook .jp-Cell').first();
    await cell.locator('.jp-InputArea-editor').click();
    await page.keyboard.press('Shift+Enter');
    const out = cell.locator('.jp-OutputArea-output');
    await out.filter({ hasText: 'no models loaded' }).first().waitFor({ timeout: 90000 });
    // the ipywidgets front end rendered the panel (not its text fallback)
    await cell.locator('.jp-OutputArea-output .widget-html').first().waitFor();

    // the magic displays the panel; it should be shown once (a returned widget shows again as Out[n])
    const panels = await cell.locator('.jp-OutputArea-output .widget-html', { hasText: 'jupyter-llama ·' }).count();
    process.stdout.write(`NOTE notebook panels rendered: ${panels}\n`);

    log('another client loads the model: the notebook widget updates');
    await call({ op: 'load' });
    await out.filter({ hasText: '1 model loaded' }).first().waitFor({ timeout: 30000 });
    await out.filter({ hasText: model }).first().waitFor();
    await page.locator(`${card}[data-state="ready"]`).waitFor({ timeout: 20000 });
    await page.waitForTimeout(600);
    await page.screenshot({ path: path.join(artifacts, 'notebook-panel.png') });
    log('screenshot notebook-panel.png');

    log('issue 56: %llama picker opens on the loaded model, says "automatic" for the context, labels its fields');
    const pickerCell = page.locator('.jp-Notebook .jp-Cell').nth(1);
    await pickerCell.locator('.jp-InputArea-editor').click();
    await page.keyboard.press('Shift+Enter');
    const pickerOut = pickerCell.locator('.jp-OutputArea-output');
    await pickerOut.locator('.widget-dropdown select').first().waitFor({ timeout: 60000 });
    await pickerOut.filter({ hasText: 'comes to' }).first().waitFor({ timeout: 60000 }); // the estimate is in
    const controls = await pickerOut.locator('.widget-inline-hbox').evaluateAll(els =>
      els
        .filter(el => el.offsetParent !== null) // shown
        .map(el => ({
          label: el.querySelector(':scope > .widget-label')?.textContent ?? null,
          value: el.querySelector('select')?.selectedOptions[0]?.textContent ?? el.querySelector('input')?.value ?? null
        }))
    );
    const byLabel = Object.fromEntries(controls.filter(c => c.label).map(c => [c.label, c.value]));
    if (!String(byLabel['model'] ?? '').startsWith(model)) {
      throw new Error(`the picker opened on ${byLabel['model']}, not the loaded ${model}: ${JSON.stringify(controls)}`);
    }
    if (byLabel['context'] !== 'automatic') {
      throw new Error(`the context reads "${byLabel['context']}", not "automatic": ${JSON.stringify(controls)}`);
    }
    for (const c of controls) {
      if ((c.value !== null && c.value !== '' && c.label !== null && c.label.trim().length < 2) || c.label === 'N') {
        throw new Error(`an unlabelled field in the picker: ${JSON.stringify(c)}`);
      }
      if (c.value === '0' && c.label !== 'max tokens') {
        throw new Error(`a bare 0 in the picker: ${JSON.stringify(c)}`);
      }
    }
    await page.waitForTimeout(400);
    await pickerCell.scrollIntoViewIfNeeded();
    await page.screenshot({ path: path.join(artifacts, 'notebook-picker.png') });
    log(`picker controls ${JSON.stringify(byLabel)}; screenshot notebook-picker.png`);

    log('another client unloads it: the notebook widget updates');
    await call({ op: 'unload' });
    await out.filter({ hasText: 'no models loaded' }).first().waitFor({ timeout: 30000 });
    await page.locator(card).waitFor({ state: 'detached', timeout: 20000 });

    // a minute of polls, loads and unloads later: still one show call per model
    const perModel = {};
    for (const m of showCalls) {
      perModel[m] = (perModel[m] ?? 0) + 1;
    }
    log(`api/show calls from the page: ${JSON.stringify(perModel)}`);
    if (!perModel[presetModel] || Object.values(perModel).some(n => n > 1)) {
      throw new Error(`the panel should ask api/show once per model and digest: ${JSON.stringify(perModel)}`);
    }

    log('issue 56: with no model registered, the help text shows its command as code');
    await call({ op: 'delete_all' });
    const empty = page.locator(`${panel} [data-section="models"] .jp-Llama-empty`);
    await empty.waitFor({ timeout: 30000 });
    const emptyText = await empty.innerText();
    const code = await empty.locator('code').allInnerTexts();
    if (emptyText.includes('`') || !code.includes('jupyter-llama create')) {
      throw new Error(`the empty panel's help: "${emptyText}" (code: ${JSON.stringify(code)})`);
    }
    await page.waitForTimeout(300);
    await page.locator(panel).screenshot({ path: path.join(artifacts, 'lab-panel-empty.png') });
    log(`"${emptyText}"; screenshot lab-panel-empty.png`);

    checkErrors();
    log('done');
  } catch (e) {
    const page = context.pages()[0];
    if (page) {
      await page.screenshot({ path: path.join(artifacts, 'lab-failure.png') }).catch(() => undefined);
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
