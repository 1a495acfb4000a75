// Issue 56 (item 9): what a newcomer reads in the panel. The memory bars of the loaded
// models share one scale that is said; a pull shows its speed and time left; a failed pull
// says what was not found once; help text shows commands as code, not backticks.
import { describe, expect, it } from 'vitest';

import {
  IPs,
  TransferRate,
  codeSpans,
  errorMessage,
  loadedRows,
  memoryScale,
  memoryScaleText,
  niceBytes,
  pullErrorText,
  pullProgress,
  rateText,
  roundBytesText
} from '../src/model';

const KiB = 1024;
const MiB = 1024 ** 2;
const GiB = 1024 ** 3;

function model(name: string, actual: { [dev: string]: number } | null, detailed: { [dev: string]: number }) {
  const rep = (by: { [dev: string]: number }) => ({
    devices: Object.fromEntries(Object.entries(by).map(([d, n]) => [d, { weights: n }]))
  });
  return { name, memory: { detailed: rep(detailed), ...(actual ? { actual: rep(actual) } : {}) } };
}

describe('the memory bars share one scale', () => {
  it('rounds the largest figure up to a round number, never onto it', () => {
    expect(niceBytes(13.2 * MiB)).toBe(15 * MiB);
    expect(niceBytes(4 * GiB)).toBe(5 * GiB);
    expect(niceBytes(3837789)).toBe(4 * MiB);
    expect(niceBytes(700 * MiB)).toBe(800 * MiB);
    expect(niceBytes(0)).toBeGreaterThan(KiB);
    expect(roundBytesText(15 * MiB)).toBe('15 MiB');
    expect(roundBytesText(1.5 * GiB)).toBe('1.5 GiB');
    expect(roundBytesText(1.25 * GiB)).toBe('1.25 GiB');
  });

  it("a small model's bar is short beside a large one's: a bar's length is bytes", () => {
    const ps: IPs = {
      models: [
        model('big', { 'cuda:0': 6 * GiB, cpu: 512 * MiB }, { 'cuda:0': 6.2 * GiB, cpu: 500 * MiB }),
        model('small', { cpu: 600 * MiB }, { cpu: 640 * MiB })
      ]
    };
    const [big, small] = loadedRows(ps, null, 0);
    const scale = 8 * GiB; // 6.2 GiB (the big one's prediction) rounded up
    for (const d of [...big.devices, ...small.devices]) {
      expect(d.scale).toBe(scale);
    }
    expect(memoryScale([big, small])).toBe(scale);
    const bigGpu = big.devices.find(d => d.device === 'cuda:0')!;
    const smallCpu = small.devices[0];
    expect(bigGpu.fillPct).toBeCloseTo((100 * 6 * GiB) / scale, 6);
    expect(smallCpu.fillPct).toBeCloseTo((100 * 600 * MiB) / scale, 6);
    // the same bytes, the same length, whichever model and device
    expect(smallCpu.fillPct / bigGpu.fillPct).toBeCloseTo(600 / (6 * 1024), 6);
    const marker = bigGpu.markers.find(m => m.source === 'detailed')!;
    expect(marker.pct).toBeCloseTo((100 * 6.2 * GiB) / scale, 6);
    expect(marker.offScale).toBe(false);
    expect(memoryScaleText([big, small])).toBe("Memory bars share one scale, 0 to 8 GiB: a bar's length is bytes.");
  });

  it('a model not yet measured is drawn at its prediction, on the same scale', () => {
    const [r] = loadedRows({ models: [model('loading', null, { cpu: 3 * MiB })] }, null, 0);
    expect(r.devices[0].scale).toBe(4 * MiB);
    expect(r.devices[0].fillPct).toBeCloseTo(75, 6);
  });

  it('no model, no scale', () => {
    expect(memoryScale(loadedRows({ models: [] }, null, 0))).toBeNull();
    expect(memoryScaleText([])).toBeNull();
  });
});

describe('pull speed and time left', () => {
  it('measures the bytes completed over time, and says nothing before a second of it', () => {
    const r = new TransferRate(8, 1);
    expect(r.add(100, 'sha256:a', 0, 100 * MiB)).toEqual({ bytesPerSecond: null, secondsLeft: null });
    expect(r.add(100.5, 'sha256:a', 5 * MiB, 100 * MiB).bytesPerSecond).toBeNull();
    const at2 = r.add(102, 'sha256:a', 20 * MiB, 100 * MiB);
    expect(at2.bytesPerSecond).toBeCloseTo(10 * MiB, 3);
    expect(at2.secondsLeft).toBeCloseTo(8, 6);
    expect(rateText(at2)).toBe('10.0 MiB/s · about 8s left');
  });

  it('follows the latest seconds, not the average since the start', () => {
    const r = new TransferRate(4, 1);
    r.add(0, 'f', 0, GiB);
    r.add(2, 'f', 2 * MiB, GiB); // slow start: 1 MiB/s
    for (let t = 3; t <= 12; t++) {
      r.add(t, 'f', 2 * MiB + (t - 2) * 10 * MiB, GiB); // then 10 MiB/s
    }
    const now = r.add(13, 'f', 2 * MiB + 11 * 10 * MiB, GiB);
    expect(now.bytesPerSecond).toBeCloseTo(10 * MiB, 3);
  });

  it('starts afresh for another file, or a download begun again', () => {
    const r = new TransferRate(8, 1);
    r.add(0, 'a', 0, 10 * MiB);
    r.add(2, 'a', 10 * MiB, 10 * MiB);
    expect(r.add(3, 'b', 0, 50 * MiB).bytesPerSecond).toBeNull();
    r.add(5, 'b', 20 * MiB, 50 * MiB);
    expect(r.add(6, 'b', 1 * MiB, 50 * MiB).bytesPerSecond).toBeNull();
  });

  it('a stalled download says so rather than an endless time', () => {
    const r = new TransferRate(8, 1);
    r.add(0, 'a', 5 * MiB, 10 * MiB);
    const s = r.add(3, 'a', 5 * MiB, 10 * MiB);
    expect(s).toEqual({ bytesPerSecond: 0, secondsLeft: null });
    expect(rateText(s)).toBe('0 B/s · stalled');
  });

  it('the progress line carries them once known', () => {
    const st = { status: 'pulling sha256:ab', total: 4 * MiB, completed: MiB };
    expect(pullProgress(st).text).toBe('pulling sha256:ab: 1.0 MiB / 4.0 MiB (25%)');
    expect(pullProgress(st, { bytesPerSecond: 512 * KiB, secondsLeft: 6 }).text).toBe(
      'pulling sha256:ab: 1.0 MiB / 4.0 MiB (25%) · 512.0 KiB/s · about 6s left'
    );
    expect(pullProgress(st, { bytesPerSecond: null, secondsLeft: null }).text).toBe(
      'pulling sha256:ab: 1.0 MiB / 4.0 MiB (25%)'
    );
  });
});

describe('a failed pull says what was not found, once', () => {
  const url = 'http://127.0.0.1:8000/missing.gguf';
  it('a 404 for the address pulled: one sentence, no address again', () => {
    // the server's words, as the stream's error line carries them
    const text = pullErrorText(url, `${url}: not found (HTTP 404 File not found)`);
    expect(text).toBe('nothing is at this address (HTTP 404 not found).');
    expect(text).not.toContain(url);
    // and when it came as the answer's status (errorMessage adds it)
    const withStatus = errorMessage({ error: `${url}: not found (HTTP 404 Not Found)` }, 400);
    expect(pullErrorText(url, withStatus)).toBe('nothing is at this address (HTTP 404 not found).');
  });

  it('a file of a repository the source names is named', () => {
    const file = 'https://huggingface.co/o/r/resolve/main/m.gguf';
    expect(pullErrorText('hf.co/o/r', `${file}: not found (HTTP 404 Not Found)`)).toBe(
      `the server has no file ${file} (HTTP 404 not found).`
    );
  });

  it('other messages lose only a repeated source and a repeated status', () => {
    expect(pullErrorText(url, `${url}: access denied (HTTP 403 Forbidden)`)).toBe('access denied (HTTP 403 Forbidden)');
    expect(pullErrorText('x', 'model "x" not found in registry r: no such model or tag (HTTP 404)')).toBe(
      'model "x" not found in registry r: no such model or tag (HTTP 404)'
    );
    expect(pullErrorText('x', 'refused (HTTP 404 Not Found) (HTTP 404)')).toBe('refused (HTTP 404 Not Found)');
    expect(pullErrorText(url, 'download of missing.gguf failed after 0 bytes')).toBe(
      'download of missing.gguf failed after 0 bytes'
    );
  });
});

describe('help text', () => {
  it('splits code spans out of backticks', () => {
    expect(codeSpans('Pull one below, or `jupyter-llama create`.')).toEqual([
      { text: 'Pull one below, or ', code: false },
      { text: 'jupyter-llama create', code: true },
      { text: '.', code: false }
    ]);
    expect(codeSpans('no code')).toEqual([{ text: 'no code', code: false }]);
    expect(codeSpans('an odd ` stays')).toEqual([{ text: 'an odd ` stays', code: false }]);
  });
});
