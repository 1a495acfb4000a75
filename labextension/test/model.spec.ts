import { describe, expect, it } from 'vitest';

import {
  ErrorGate,
  IDevices,
  IPs,
  ITags,
  NdjsonSplitter,
  countdownText,
  deviceOrder,
  deviceRows,
  durationText,
  errorMessage,
  eventRows,
  formatBytes,
  formatBytesShort,
  keepAlive,
  loadedRows,
  modelRows,
  parseTime,
  pollFrequency,
  pullProgress,
  reportByDevice,
  sameModel,
  signedPct,
  statusSummary
} from '../src/model';

// Answers recorded from a real server with one synthetic model loaded on the CPU.
import fixture from './fixtures/loaded-cpu.json';

const tags = fixture.tags as ITags;
const ps = fixture.ps as IPs;
const devices = fixture.devices as IDevices;

const GiB = 1024 ** 3;
const MiB = 1024 ** 2;

describe('formatBytes', () => {
  it('matches the Python side', () => {
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytes(1023)).toBe('1023 B');
    expect(formatBytes(1536)).toBe('1.5 KiB');
    expect(formatBytes(3837789)).toBe('3.7 MiB');
    expect(formatBytes(3 * GiB)).toBe('3.00 GiB');
    expect(formatBytes(-2 * MiB)).toBe('-2.0 MiB');
  });
  it('shows a dash for nothing', () => {
    expect(formatBytes(null)).toBe('-');
    expect(formatBytes(undefined)).toBe('-');
    expect(formatBytes(NaN)).toBe('-');
  });
  it('has a short form for GiB', () => {
    expect(formatBytesShort(25276063744)).toBe('23.5 GiB');
    expect(formatBytesShort(1536)).toBe('1.5 KiB');
  });
});

describe('signedPct', () => {
  it('signs, decimals and zero', () => {
    expect(signedPct(-0.23)).toBe('−0.2%');
    expect(signedPct(4.56)).toBe('+4.6%');
    expect(signedPct(-12.4)).toBe('−12%');
    expect(signedPct(0.01)).toBe('±0.0%');
  });
});

describe('durations and times', () => {
  it('durationText', () => {
    expect(durationText(9)).toBe('9s');
    expect(durationText(-3)).toBe('0s');
    expect(durationText(75)).toBe('1m 15s');
    expect(durationText(3700)).toBe('1h 01m');
    expect(durationText(90000)).toBe('1d 01h');
  });
  it('parseTime reads RFC 3339 with microseconds, Z, offsets and epoch numbers', () => {
    expect(parseTime('2026-01-01T00:00:00Z')).toBe(Date.UTC(2026, 0, 1) / 1000);
    expect(parseTime('2026-01-01T00:00:00.123456+00:00')).toBeCloseTo(Date.UTC(2026, 0, 1) / 1000 + 0.123, 3);
    expect(parseTime('2026-01-01T02:00:00+02:00')).toBe(Date.UTC(2026, 0, 1) / 1000);
    expect(parseTime('2026-01-01T00:00:00')).toBe(Date.UTC(2026, 0, 1) / 1000);
    expect(parseTime(12.5)).toBe(12.5);
    expect(parseTime('')).toBeNull();
    expect(parseTime(null)).toBeNull();
    expect(parseTime('not a time')).toBeNull();
  });
});

describe('keep-alive', () => {
  const exp = '2026-01-01T00:05:00Z';
  const now = Date.UTC(2026, 0, 1) / 1000;
  it('counts down for an idle model', () => {
    const ka = keepAlive({ expires_at: exp, refcount: 0 }, now);
    expect(ka.text).toBe('unloads in 5m 00s');
    expect(ka.secondsLeft).toBe(300);
    expect(ka.expiresAt).toBe(now + 300);
    expect(countdownText(ka.expiresAt!, now + 299)).toBe('unloads in 1s');
    expect(countdownText(ka.expiresAt!, now + 301)).toBe('unloading now');
  });
  it('says busy while requests are in flight', () => {
    const ka = keepAlive({ expires_at: exp, refcount: 2 }, now);
    expect(ka.text).toBe('busy; unloads 5m 00s after its last request');
    expect(ka.expiresAt).toBeNull();
  });
  it('knows pinned and far-future models stay', () => {
    expect(keepAlive({ pinned: true }, now).text).toMatch(/kept loaded/);
    expect(keepAlive({ expires_at: '2318-01-01T00:00:00Z' }, now).text).toMatch(/kept loaded/);
    expect(keepAlive({}, now).text).toBe('no expiry');
    expect(keepAlive({ expires_at: exp }, now + 400).text).toBe('unloading now');
  });
});

describe('registered models', () => {
  it('one row per model with loaded state', () => {
    const rows = modelRows(tags, ps);
    expect(rows).toHaveLength(1);
    expect(rows[0]).toMatchObject({
      name: 'tiny:latest',
      size: 670176,
      sizeText: '654.5 KiB',
      quantization: 'F32',
      parameters: '164K',
      family: 'llama',
      loaded: true,
      state: 'ready'
    });
    expect(modelRows(tags, { models: [] })[0].loaded).toBe(false);
    expect(modelRows(null)).toEqual([]);
  });
  it('treats "x" and "x:latest" as the same model, and sorts by name', () => {
    expect(sameModel('tiny', 'tiny:latest')).toBe(true);
    expect(sameModel('tiny:q4', 'tiny:latest')).toBe(false);
    expect(sameModel('TINY:Latest', 'library/tiny')).toBe(true);
    const rows = modelRows(
      { models: [{ name: 'b' }, { name: 'a:latest' }] },
      { models: [{ name: 'b:latest', state: 'loading' }] }
    );
    expect(rows.map(r => [r.name, r.loaded, r.state])).toEqual([
      ['a:latest', false, null],
      ['b', true, 'loading']
    ]);
  });
});

describe('loaded models', () => {
  const now = parseTime(ps.models![0].expires_at)! - 299.4;
  const rows = loadedRows(ps, devices, now);
  it('reads the recorded ps answer', () => {
    expect(rows).toHaveLength(1);
    const r = rows[0];
    expect(r.name).toBe('tiny:latest');
    expect(r.state).toBe('ready');
    expect(r.context).toBe(1024);
    expect(r.layers).toBe('0 (CPU only)');
    expect(r.refcount).toBe(0);
    expect(r.keepAlive.text).toBe('unloads in 4m 59s');
    expect(r.hasActual).toBe(true);
  });
  it('has one memory bar per device with the prediction marked', () => {
    const d = rows[0].devices;
    expect(d.map(x => x.device)).toEqual(['cpu']);
    const cpu = d[0];
    expect(cpu.actual).toBe(3837789);
    expect(cpu.predicted).toBe(3829024);
    expect(cpu.predictedSource).toBe('detailed');
    expect(cpu.errorPct).toBeCloseTo((100 * (3829024 - 3837789)) / 3837789, 6);
    // one scale for every bar: the largest figure shown (3.7 MiB), rounded up (4 MiB)
    expect(cpu.scale).toBe(4 * MiB);
    expect(cpu.fillPct).toBeCloseTo((100 * 3837789) / (4 * MiB), 4);
    const det = cpu.markers.find(m => m.source === 'detailed')!;
    expect(det.pct).toBeCloseTo((100 * 3829024) / (4 * MiB), 4);
    expect(det.offScale).toBe(false);
    // the coarse prediction (2 GiB of "other") is far off this scale: drawn at the edge
    const coarse = cpu.markers.find(m => m.source === 'coarse')!;
    expect(coarse.offScale).toBe(true);
    expect(coarse.pct).toBe(100);
    expect(cpu.capacityKind).toBe('total');
    expect(cpu.text).toBe(
      'actual 3.7 MiB · predicted 3.7 MiB (detailed, −0.2%) · coarse 2.00 GiB · <0.1% of the total'
    );
  });
  it('GPU layers, budgets and unknown actual figures', () => {
    const model = {
      name: 'big',
      size_vram: 5 * GiB,
      layers_offloaded: 30,
      layers_total: 33,
      refcount: 1,
      memory: {
        detailed: { devices: { 'cuda:0': { weights: 4 * GiB }, cpu: { weights: GiB } } }
      }
    };
    const dev: IDevices = {
      devices: [
        { id: 'cpu', total: 64 * GiB, free: 60 * GiB },
        { id: 'cuda:0', name: 'H100', total: 80 * GiB, free: 70 * GiB, budget: 8 * GiB, overhead: GiB, available: 4 * GiB }
      ],
      loaded: [{ name: 'big', by_device: { 'cuda:0': 4 * GiB, cpu: GiB } }]
    };
    const [r] = loadedRows({ models: [model] }, dev, 0);
    expect(r.layers).toBe('30/33');
    expect(r.hasActual).toBe(false);
    expect(r.devices.map(d => d.device)).toEqual(['cuda:0', 'cpu']);
    const gpu = r.devices[0];
    expect(gpu.actual).toBeNull();
    expect(gpu.capacityKind).toBe('budget');
    expect(gpu.sharePct).toBe(50);
    expect(gpu.text).toBe('actual: not yet known · predicted 4.00 GiB (detailed) · 50.0% of the budget');
    expect(gpu.scale).toBe(5 * GiB); // above the largest figure (4 GiB): no bar looks full
    expect(gpu.fillPct).toBeCloseTo(80, 4);
    const [g, c] = deviceRows(dev);
    expect(g.device).toBe('cuda:0');
    expect(g.capacity).toBe(8 * GiB);
    expect(g.used).toBe(4 * GiB);
    expect(g.usedPct).toBe(50);
    expect(g.available).toBe(4 * GiB); // the scheduler's figure, as given
    expect(c.available).toBeNull(); // none given: no figure is made up
    expect(c.text).not.toContain('left to plan with');
    expect(c.capacityKind).toBe('total');
    expect(loadedRows({ models: [{ name: 'x', size_vram: 1, layers_total: 10 }] }, null, 0)[0].layers).toBe('?');
    expect(loadedRows({ models: [{ name: 'x', layers_total: 10 }] }, null, 0)[0].layers).toBe('0/10');
  });
  it('orders devices GPUs first, host last', () => {
    expect(deviceOrder(['cpu', 'cuda:1', 'cuda:0', 'cpu'])).toEqual(['cuda:0', 'cuda:1', 'cpu']);
    expect(reportByDevice({ devices: { cpu: { a: 1, b: 2 } } })).toEqual({ cpu: 3 });
    expect(reportByDevice(null)).toEqual({});
  });
});

describe('devices and status bar', () => {
  it('worker rows: reachable, unreachable with the reason, held by a model', () => {
    const MiB = 1024 ** 2;
    const dev: IDevices = {
      devices: [
        { id: 'rpc:127.0.0.1:50061', kind: 'rpc', total: 100 * MiB, free: 90 * MiB, budget: 64 * MiB, reachable: true,
          available: 64 * MiB },
        { id: 'rpc:127.0.0.1:50062', kind: 'rpc', total: 0, free: 0, budget: null, reachable: false,
          error: 'connection refused' },
        { id: 'rpc:127.0.0.1:50063', kind: 'rpc', total: 100 * MiB, free: 80 * MiB, budget: null, reachable: true,
          held_by: 'tiny:latest' }
      ],
      loaded: [{ name: 'tiny:latest', by_device: { 'rpc:127.0.0.1:50063': 5 * MiB } }]
    };
    const [a, b, c] = deviceRows(dev);
    expect([a.state, b.state, c.state]).toEqual(['ready', 'unreachable', 'held']);
    expect(a.capacity).toBe(64 * MiB);
    expect(a.text).toContain('left to plan with');
    expect(b.text).toBe('unreachable: connection refused · left out of placement');
    expect(c.heldBy).toBe('tiny:latest');
    expect(c.used).toBe(5 * MiB);
    expect(c.text).toContain('in use by tiny:latest');
    expect(c.text).not.toContain('left to plan with');
    // the status bar names the worker in use, never the one that does not answer
    expect(statusSummary({ models: [{ name: 'tiny:latest' }] }, dev).text).toBe(
      'Llama: 1 model · 5.0 MiB / 100.0 MiB rpc:127.0.0.1:50063'
    );
  });
  it('device rows from the recorded answer', () => {
    const [cpu] = deviceRows(devices);
    expect(cpu.device).toBe('cpu');
    expect(cpu.name).toBe('host memory');
    expect(cpu.used).toBe(3837789);
    expect(cpu.budget).toBeNull();
    expect(cpu.text).toBe('22.60 GiB free · no budget · 22.60 GiB left to plan with');
    expect(cpu.capacity).toBe(25276063744);
    expect(cpu.available).toBe(24262078464);
  });
  it('summarises loaded models and memory against the budget', () => {
    const s = statusSummary(ps, devices);
    expect(s.loaded).toBe(1);
    expect(s.text).toBe('Llama: 1 model · 3.7 MiB / 23.5 GiB');
    expect(s.title).toContain('cpu (host memory): 3.7 MiB used by loaded models of 23.54 GiB (total); 22.60 GiB free');
    expect(statusSummary(null, null).text).toBe('Llama: 0 models');
    const two = statusSummary(
      { models: [] },
      { devices: [{ id: 'cpu', total: GiB }, { id: 'cuda:0', total: 2 * GiB, budget: GiB }] }
    );
    expect(two.text).toBe('Llama: 0 models · 0 B / 1.0 GiB cuda:0');
  });
});

describe('scheduler decisions', () => {
  it('newest first, limited, with plain words', () => {
    const rows = eventRows(fixture.events, 3);
    expect(rows.map(r => r.seq)).toEqual([4, 3, 2]);
    expect(rows[0].kind).toBe('unload');
    expect(rows[0].message).toBe('unloaded tiny:latest: unloaded on request (keep_alive 0)');
    expect(rows[0].time).toMatch(/^\d\d:\d\d:\d\d$/);
    expect(eventRows([], 5)).toEqual([]);
    expect(eventRows(null)).toEqual([]);
  });
});

describe('pull progress', () => {
  it('turns NDJSON status lines into a bar', () => {
    expect(pullProgress({ status: 'pulling sha256:ab', total: 4 * MiB, completed: MiB })).toEqual({
      fraction: 0.25,
      text: 'pulling sha256:ab: 1.0 MiB / 4.0 MiB (25%)',
      done: false,
      error: null
    });
    expect(pullProgress({ status: 'verifying sha256 digest' }).fraction).toBeNull();
    expect(pullProgress({ status: 'success', model: 'tiny:latest' })).toMatchObject({
      fraction: 1,
      done: true,
      text: 'success: tiny:latest'
    });
    expect(pullProgress({ error: 'HTTP 404' })).toMatchObject({ done: true, error: 'HTTP 404' });
    expect(pullProgress({ status: 'x', total: 10, completed: 20 }).fraction).toBe(1);
  });
  it('splits NDJSON across chunk boundaries', () => {
    const s = new NdjsonSplitter();
    expect(s.push('{"a":1}\n{"b"')).toEqual([{ a: 1 }]);
    expect(s.push(':2}\n\n{"c":3}')).toEqual([{ b: 2 }]);
    expect(s.end()).toEqual([{ c: 3 }]);
    expect(s.end()).toEqual([]);
  });
});

describe('polling policy', () => {
  it('clamps the interval and backs off up to a ceiling', () => {
    expect(pollFrequency(3)).toEqual({ interval: 3000, backoff: 2, max: 90000 });
    expect(pollFrequency(0.1).interval).toBe(1000);
    expect(pollFrequency(-5).interval).toBe(3000);
    expect(pollFrequency(NaN).interval).toBe(3000);
    expect(pollFrequency(60).max).toBe(300000);
    expect(pollFrequency(10000)).toEqual({ interval: 600000, backoff: 2, max: 600000 });
  });
  it('notifies once per outage, and when the message changes', () => {
    const g = new ErrorGate();
    expect(g.success()).toBe(false);
    expect(g.fail('down')).toBe(true);
    expect(g.fail('down')).toBe(false);
    expect(g.failing).toBe(true);
    expect(g.fail('403 forbidden')).toBe(true);
    expect(g.message).toBe('403 forbidden');
    expect(g.success()).toBe(true);
    expect(g.success()).toBe(false);
    expect(g.fail('down')).toBe(true);
  });
  it('reads API error bodies', () => {
    expect(errorMessage({ error: 'model "x" not found' }, 404)).toBe('model "x" not found (HTTP 404)');
    expect(errorMessage({ error: { message: 'bad' } }, 400)).toBe('bad (HTTP 400)');
    expect(errorMessage('oops\ntrace', 500)).toBe('oops (HTTP 500)');
    expect(errorMessage(null, 502)).toBe('request failed (HTTP 502)');
    expect(errorMessage(null)).toBe('request failed');
    expect(errorMessage({ error: 'x' })).toBe('x');
  });
});
