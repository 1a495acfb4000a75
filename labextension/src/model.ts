/**
 * Pure functions that turn the jupyter-llama REST answers (api/tags, api/ps,
 * api/show, api/devices, api/events, api/pull progress) into view rows and words.
 *
 * Nothing here touches the DOM, the network or JupyterLab, so all of it is
 * unit-tested in plain Node.
 */

// ---------------------------------------------------------------- API shapes

/** Bytes per component on one device (``MemoryReport.to_dict()["devices"][dev]``). */
export type Components = { [component: string]: number };

/** One memory report: a prediction (coarse, detailed, llama.cpp) or the actual figures. */
export interface IMemoryReport {
  source?: string;
  devices?: { [device: string]: Components };
  total?: number;
  layers_offloaded?: number | null;
  layers_total?: number | null;
  n_ctx?: number | null;
  warnings?: string[];
}

export interface IModelDetails {
  format?: string;
  family?: string;
  parameter_size?: string;
  quantization_level?: string;
}

/** One entry of ``GET api/tags``. */
export interface ITagModel {
  name?: string;
  model?: string;
  size?: number;
  digest?: string;
  modified_at?: string;
  details?: IModelDetails;
}

export interface ITags {
  models?: ITagModel[];
}

/** A model's preset as the server stores it (``show``'s ``preset``, jupyter-llama's own field). */
export interface IShowPreset {
  system?: string;
  template?: string;
  parameters?: { [name: string]: unknown };
  messages?: { role?: string; content?: string }[];
  license?: string[];
}

/** ``POST api/show``: the fields the panel reads (Ollama's, plus ``preset``). */
export interface IShow {
  name?: string;
  digest?: string;
  system?: string;
  /** Ollama's text form: one ``name value`` line per parameter (per stop sequence). */
  parameters?: string;
  /** The preset's template, else the GGUF's own chat template (as Ollama answers). */
  template?: string;
  messages?: { role?: string; content?: string }[];
  modelfile?: string;
  preset?: IShowPreset | null;
}

/** One entry of ``GET api/ps`` (Ollama's fields plus the scheduler's). */
export interface IPsModel {
  name?: string;
  model?: string;
  size?: number;
  size_vram?: number;
  details?: IModelDetails;
  expires_at?: string | null;
  context_length?: number;
  state?: string | null;
  refcount?: number;
  pinned?: boolean;
  options?: { [key: string]: unknown } | null;
  layers_offloaded?: number | null;
  layers_total?: number | null;
  pid?: number | null;
  memory?: { [source: string]: IMemoryReport | null } | null;
  // On a manager shared through a JupyterHub (absent on a single user's): who loaded and
  // uses the model, as the viewer may see it. An admin sees every name; anyone else sees
  // themselves, and how many others there are.
  /** The user whose request loaded it; null when no user's did, or (to a non-admin) another's. */
  loaded_by?: string | null;
  /** Requests in flight per user (to a non-admin: their own only). */
  users?: { [user: string]: number };
  /** The users whose requests have used it (to a non-admin: at most themselves). */
  used_by?: string[];
  /** Requests waiting for a turn per user (to a non-admin: their own only). */
  waiting?: { [user: string]: number };
  /** How many other users use it, hold it or wait for it (to a non-admin only). */
  other_users?: number;
}

export interface IPs {
  models?: IPsModel[];
}

export interface IDevice {
  id: string;
  name?: string;
  total?: number;
  free?: number;
  budget?: number | null;
  overhead?: number;
  usable?: number;
  /** ``host``, ``gpu`` or ``rpc`` (a ggml-rpc-server worker). */
  kind?: string;
  /** False for a worker that did not answer its probe (``error`` says why). */
  reachable?: boolean;
  error?: string | null;
  /** The loaded model holding this worker (a worker serves one llama-server at a time). */
  held_by?: string | null;
  /** What a new model may still use here: the scheduler's own figure (absent without one). */
  available?: number | null;
}

/** ``GET api/devices``. */
export interface IDevices {
  devices?: IDevice[];
  usage?: { [device: string]: number };
  loaded?: {
    name: string;
    state?: string;
    source?: string;
    by_device?: { [device: string]: number };
  }[];
  budgets?: {
    limits?: { [device: string]: number };
    gpu_overhead?: number;
    limits_source?: string;
    overhead_source?: string;
  };
  gpu_error?: string | null;
}

/** ``GET api/me``: who this page's user is to the manager (the fields the panel reads). */
export interface IMe {
  name?: string;
  /** True on a manager shared through a JupyterHub. */
  shared?: boolean;
  /** Whether they administer the shared manager (may unload any model). */
  admin?: boolean;
}

/** One scheduler decision from ``GET api/events``. */
export interface IEvent {
  seq?: number;
  time?: number;
  kind?: string;
  model?: string | null;
  message?: string;
  data?: unknown;
}

/** One line of ``POST api/pull``'s NDJSON stream. */
export interface IPullStatus {
  status?: string;
  digest?: string;
  total?: number;
  completed?: number;
  model?: string;
  error?: string;
}

// ---------------------------------------------------------------- constants

export const ACTUAL = 'actual';
export const DETAILED = 'detailed';
export const COARSE = 'coarse';
export const LLAMA_CPP = 'llama.cpp'; // the source name the server uses (memory/report.py)

/** An ``expires_at`` further away than this means "kept loaded for good". */
export const FOREVER_S = 50 * 365 * 86400;

const KiB = 1024;
const MiB = 1024 * KiB;
const GiB = 1024 * MiB;

// ---------------------------------------------------------------- words

/** ``1536`` -> ``1.5 KiB``; ``3 * 2**30`` -> ``3.00 GiB`` (the Python side's format). */
export function formatBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !Number.isFinite(n)) {
    return '-';
  }
  const sign = n < 0 ? '-' : '';
  const a = Math.abs(n);
  if (a >= GiB) {
    return `${sign}${(a / GiB).toFixed(2)} GiB`;
  }
  if (a >= MiB) {
    return `${sign}${(a / MiB).toFixed(1)} MiB`;
  }
  if (a >= KiB) {
    return `${sign}${(a / KiB).toFixed(1)} KiB`;
  }
  return `${sign}${Math.trunc(a)} B`;
}

/** Shorter, for tight places: like formatBytes, but GiB with one decimal (``22.6 GiB``). */
export function formatBytesShort(n: number | null | undefined): string {
  if (n !== null && n !== undefined && Number.isFinite(n) && Math.abs(n) >= GiB) {
    return `${(n / GiB).toFixed(1)} GiB`;
  }
  return formatBytes(n);
}

/** ``9`` -> ``9s``; ``75`` -> ``1m 15s``; ``3700`` -> ``1h 01m``; ``90000`` -> ``1d 01h``. */
export function durationText(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  const pad = (v: number) => String(v).padStart(2, '0');
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)}h ${pad(Math.floor((s % 3600) / 60))}m`;
  }
  return `${Math.floor(s / 86400)}d ${pad(Math.floor((s % 86400) / 3600))}h`;
}

/** RFC 3339 text (or epoch seconds) -> epoch seconds; null when absent or unreadable. */
export function parseTime(value: unknown): number | null {
  if (value === null || value === undefined || value === '') {
    return null;
  }
  if (typeof value === 'number') {
    return Number.isFinite(value) ? value : null;
  }
  if (typeof value !== 'string') {
    return null;
  }
  let text = value.trim();
  // Date.parse wants at most millisecond precision and an explicit zone.
  text = text.replace(/(\.\d{3})\d+/, '$1');
  if (!/(Z|[+-]\d{2}:?\d{2})$/i.test(text)) {
    text += 'Z';
  }
  const ms = Date.parse(text);
  return Number.isNaN(ms) ? null : ms / 1000;
}

/** A signed percentage with a true minus sign: one decimal under 10 %, none above. */
export function signedPct(v: number): string {
  const a = Math.abs(v);
  const digits = a < 10 ? 1 : 0;
  const text = a.toFixed(digits);
  if (Number(text) === 0) {
    return `±${text}%`;
  }
  return `${v > 0 ? '+' : '−'}${text}%`;
}

/** ``"1 model"``, ``"2 models"``. */
export function plural(n: number, word: string): string {
  return `${n} ${word}${n === 1 ? '' : 's'}`;
}

/** Devices in display order: GPUs (by id) first, host memory last. */
export function deviceOrder(devs: Iterable<string>): string[] {
  return Array.from(new Set(devs)).sort((a, b) => {
    if (a === b) {
      return 0;
    }
    if (a === 'cpu') {
      return 1;
    }
    if (b === 'cpu') {
      return -1;
    }
    return a < b ? -1 : 1;
  });
}

/** ``MemoryReport`` -> {device: total bytes}. */
export function reportByDevice(report: IMemoryReport | null | undefined): {
  [device: string]: number;
} {
  const out: { [device: string]: number } = {};
  for (const [dev, comps] of Object.entries(report?.devices ?? {})) {
    out[dev] = Object.values(comps ?? {}).reduce(
      (s, v) => s + (Number(v) || 0),
      0
    );
  }
  return out;
}

// ---------------------------------------------------------------- who holds a model

/** Who loaded and uses a loaded model, in words, and whether this viewer may unload it. */
export interface IPeople {
  /** ``loaded by another user · used by you and 2 others``; '' when there is nobody to name. */
  text: string;
  /** The pieces of ``text`` (joined with `` · ``), so a view can keep each on one line. */
  parts: string[];
  /** The tooltip of that line: what the viewer is shown of the others. */
  title: string;
  /** Whether the manager lets this viewer unload the model. */
  mayUnload: boolean;
  /** Why it does not, for the Unload button's tooltip; null when it does. */
  refusal: string | null;
}

/** Whether a ``ps`` entry says who holds the model: only a manager shared through a JupyterHub
 * adds those fields. */
export function hasPeople(m: IPsModel | null | undefined): boolean {
  return !!m && typeof m === 'object' && ('loaded_by' in m || 'used_by' in m);
}

/** The refusal of a non-admin's unload of a model another user's request loaded. */
export const LOADED_BY_ANOTHER =
  "another user's request loaded it; only they or an admin can unload it " +
  '(it unloads by itself once idle for its keep_alive)';

/** The refusal of a non-admin's unload while other users' requests are in flight on it. */
export const IN_USE_BY_OTHERS =
  'other users are using it now; it unloads by itself once idle for its keep_alive';

/**
 * Who loaded and uses the model of ``ps`` entry ``m``, as the manager lets the viewer see it,
 * and whether it lets them unload it; null on a single user's manager (no such fields).
 *
 * An admin (``me.admin``; before ``me`` is known, an entry without ``other_users``, which the
 * manager gives non-admins only) sees names, ``loaded by bob · used by alice, bob``, and may
 * unload any model. Anyone else sees themselves and a count: ``loaded by another user · used
 * by you and 2 others``, ``loaded by you``. The manager refuses a non-admin's unload when
 * another user's request loaded the model, or while other users' requests are in flight on
 * it (``refcount`` beyond their own ``users``), so the Unload button says so before a click.
 * ``loaded_by`` null with no other user means no user's request loaded it: theirs to unload.
 */
export function peopleOf(m: IPsModel, me?: IMe | null): IPeople | null {
  if (!hasPeople(m)) {
    return null;
  }
  const admin = typeof me?.admin === 'boolean' ? me.admin : !('other_users' in m);
  const loadedBy = typeof m.loaded_by === 'string' && m.loaded_by ? m.loaded_by : null;
  const usedBy = Array.isArray(m.used_by) ? m.used_by.filter(u => typeof u === 'string' && u) : [];
  const parts: string[] = [];
  if (admin) {
    if (loadedBy !== null) {
      parts.push(`loaded by ${loadedBy}`);
    }
    if (usedBy.length) {
      parts.push(`used by ${usedBy.join(', ')}`);
    }
    return {
      text: parts.join(' · '),
      parts,
      title: 'Who loaded this model and whose requests have used it (you administer this manager: you see every user)',
      mayUnload: true,
      refusal: null
    };
  }
  const others = Math.max(0, Math.trunc(Number(m.other_users) || 0));
  const mine = usedBy.length > 0; // (to a non-admin, used_by names at most themselves)
  const byAnother = loadedBy === null && others > 0;
  if (loadedBy !== null) {
    parts.push('loaded by you');
  } else if (byAnother) {
    parts.push('loaded by another user');
  }
  if (mine && others) {
    parts.push(`used by you and ${others} other${others === 1 ? '' : 's'}`);
  } else if (mine && loadedBy === null) {
    parts.push('used by you');
  } else if (others && !(byAnother && others === 1)) {
    // (one other user who loaded it: "loaded by another user" said it)
    parts.push(`used by ${plural(others, 'other user')}`);
  }
  const ownInFlight = Object.values(m.users ?? {}).reduce((s, n) => s + (Number(n) || 0), 0);
  const othersInFlight = (Number(m.refcount) || 0) - ownInFlight > 0;
  const refusal = byAnother ? LOADED_BY_ANOTHER : othersInFlight && others ? IN_USE_BY_OTHERS : null;
  return {
    text: parts.join(' · '),
    parts,
    title: 'Who loaded and uses this model on the shared manager: you see yourself; other users are counted, not named',
    mayUnload: refusal === null,
    refusal
  };
}

// ---------------------------------------------------------------- registry

export interface IModelRow {
  name: string;
  size: number;
  sizeText: string;
  quantization: string;
  parameters: string;
  family: string;
  loaded: boolean;
  /** The scheduler state when loaded (``loading``, ``ready``, ``unloading``), else null. */
  state: string | null;
  /** The model's preset in short (system, parameters, ...), null without one or not yet known. */
  preset: IPresetSummary | null;
  /** Who holds it, when loaded on a manager shared through a JupyterHub (see ``peopleOf``). */
  people: IPeople | null;
}

/** A registered model's preset, for its row: the short line and its tooltip. */
export interface IPresetSummary {
  /** ``system: “You are Mario…” · num_predict 3 · temperature 0 · 2 messages · custom template`` */
  text: string;
  /** The pieces of ``text`` (joined with `` · ``), so a view can keep each on one line. */
  parts: string[];
  /** The full Modelfile (``show``'s ``modelfile``). */
  title: string;
}

/** How much of the system message the summary line shows. */
export const PRESET_SYSTEM_CHARS = 40;
const PRESET_VALUE_CHARS = 24;

/** ``text`` on one line (whitespace collapsed), cut to ``max`` characters with an ellipsis
 * (at a word's end when one is near). */
export function shorten(text: string, max: number): string {
  const one = String(text ?? '').replace(/\s+/g, ' ').trim();
  const chars = Array.from(one); // never cut a surrogate pair in two
  if (chars.length <= max) {
    return one;
  }
  let cut = chars.slice(0, Math.max(1, max - 1));
  const space = cut.lastIndexOf(' ');
  if (chars[cut.length] !== ' ' && space >= Math.ceil(max * 0.6)) {
    cut = cut.slice(0, space);
  }
  return cut.join('').trimEnd() + '…';
}

/** Ollama's ``parameters`` text (``name   value`` per line) -> [name, value] pairs, in order. */
export function parametersFromText(text: string | null | undefined): [string, string][] {
  const out: [string, string][] = [];
  for (const line of String(text ?? '').split('\n')) {
    const m = /^\s*(\S+)(?:\s+(.*?))?\s*$/.exec(line);
    if (m) {
      out.push([m[1], m[2] ?? '']);
    }
  }
  return out;
}

/**
 * The summary of a model's preset from its ``api/show`` answer; null when it has none.
 *
 * The system message (shortened), each parameter with its value (a repeated one, like
 * ``stop``, once with all its values), the messages counted, ``custom template``. Reads the
 * server's ``preset`` where the answer has it: Ollama's ``template`` is the GGUF's own chat
 * template for a model without one of its own, so only ``preset.template`` says "custom";
 * without ``preset`` (an Ollama-shaped answer) the template is left out.
 */
export function presetSummary(show: IShow | null | undefined): IPresetSummary | null {
  if (!show || typeof show !== 'object') {
    return null;
  }
  const p = show.preset && typeof show.preset === 'object' ? show.preset : null;
  const system = String((p ? p.system : show.system) ?? '');
  const messages = (p ? p.messages : show.messages) ?? [];
  const template = p ? String(p.template ?? '') : '';
  const licenses = p && Array.isArray(p.license) ? p.license.filter(Boolean) : [];
  let params = parametersFromText(show.parameters);
  if (!params.length && p?.parameters && typeof p.parameters === 'object') {
    // no text form: the stored values (a list, like stop, is one value each)
    params = Object.entries(p.parameters).flatMap(([k, v]) =>
      (Array.isArray(v) ? v : [v]).map(x => [k, typeof x === 'string' ? JSON.stringify(x) : String(x)] as [string, string])
    );
  }
  const grouped = new Map<string, string[]>();
  for (const [name, value] of params) {
    grouped.set(name, [...(grouped.get(name) ?? []), value]);
  }
  const parts: string[] = [];
  if (system.trim()) {
    parts.push(`system: “${shorten(system, PRESET_SYSTEM_CHARS)}”`);
  }
  for (const [name, values] of grouped) {
    const v = values.filter(x => x !== '').map(x => shorten(x, PRESET_VALUE_CHARS)).join(' ');
    parts.push(v ? `${name} ${v}` : name);
  }
  if (Array.isArray(messages) && messages.length) {
    parts.push(plural(messages.length, 'message'));
  }
  if (template.trim()) {
    parts.push('custom template');
  }
  if (licenses.length) {
    parts.push(licenses.length === 1 ? 'license' : plural(licenses.length, 'license'));
  }
  if (!parts.length) {
    return null;
  }
  const text = parts.join(' · ');
  const modelfile = String(show.modelfile ?? '').trim();
  return { text, parts, title: modelfile || text };
}

/** The preset summary known for a registered model (by name and its tags digest). */
export type PresetLookup = (name: string, digest: string) => IPresetSummary | null | undefined;

/** Does ``name`` (from tags) name the same model as ``other`` (from ps)? ``x`` is ``x:latest``. */
/** Whether two names name the same model (``tiny`` is ``tiny:latest``; names compare
 * case-insensitively). Mirrors ``models.names.same_model``, the server's one comparison. */
export function sameModel(name: string, other: string): boolean {
  const norm = (n: string) => {
    const low = n.toLowerCase().replace(/^(local\/)?library\//, '');
    return low.includes(':') ? low : `${low}:latest`;
  };
  return norm(name) === norm(other);
}

/** One row per registered model, with whether it is loaded (and its preset, from ``presets``;
 * who holds it, as ``me`` may see it, on a shared manager). */
export function modelRows(
  tags: ITags | null | undefined,
  ps?: IPs | null,
  presets?: PresetLookup,
  me?: IMe | null
): IModelRow[] {
  const loaded = (ps?.models ?? []).map(m => ({
    name: m.name || m.model || '',
    state: m.state ?? 'ready',
    people: peopleOf(m, me)
  }));
  return (tags?.models ?? [])
    .map(m => {
      const name = m.name || m.model || '';
      const hit = loaded.find(l => sameModel(name, l.name));
      const size = Number(m.size) || 0;
      return {
        name,
        size,
        sizeText: formatBytes(size),
        quantization: m.details?.quantization_level ?? '',
        parameters: m.details?.parameter_size ?? '',
        family: m.details?.family ?? '',
        loaded: hit !== undefined,
        state: hit ? hit.state : null,
        preset: (presets && name ? presets(name, m.digest ?? '') : null) ?? null,
        people: hit ? hit.people : null
      };
    })
    .sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
}

// ---------------------------------------------------------------- loaded models

export interface IKeepAlive {
  /** Plain words: "unloads in 4m 59s", "kept loaded", "busy; ...". */
  text: string;
  /** Seconds left while the countdown runs (idle model), else null. */
  secondsLeft: number | null;
  /** Epoch seconds of the expiry when the countdown runs, else null. */
  expiresAt: number | null;
}

/** The keep-alive words for one ``api/ps`` entry at ``now`` (epoch seconds). */
export function keepAlive(model: IPsModel, now: number): IKeepAlive {
  const forever = {
    text: 'kept loaded (keep_alive < 0)',
    secondsLeft: null,
    expiresAt: null
  };
  if (model.pinned) {
    return forever;
  }
  const exp = parseTime(model.expires_at);
  if (exp === null) {
    return { text: 'no expiry', secondsLeft: null, expiresAt: null };
  }
  const left = exp - now;
  if (left > FOREVER_S) {
    return forever;
  }
  const busy = Number(model.refcount) || 0;
  if (busy > 0) {
    return {
      text: `busy; unloads ${durationText(Math.max(0, left))} after its last request`,
      secondsLeft: null,
      expiresAt: null
    };
  }
  if (left <= 0) {
    return { text: 'unloading now', secondsLeft: 0, expiresAt: exp };
  }
  return {
    text: `unloads in ${durationText(left)}`,
    secondsLeft: left,
    expiresAt: exp
  };
}

/** The countdown words for an expiry time at ``now`` (the panel re-renders them each second). */
export function countdownText(expiresAt: number, now: number): string {
  const left = expiresAt - now;
  return left <= 0 ? 'unloading now' : `unloads in ${durationText(left)}`;
}

export interface IMarker {
  source: string;
  bytes: number;
  /** Position on the bar, 0..100 (clamped). */
  pct: number;
  /** True when the prediction is past the bar's end (drawn at the edge). */
  offScale: boolean;
}

export interface IDeviceMemory {
  device: string;
  /** Bytes llama.cpp allocated (from its log); null while not yet known. */
  actual: number | null;
  /** The prediction the scheduler fits with (detailed, else coarse, else llama.cpp's). */
  predicted: number | null;
  predictedSource: string | null;
  /** Every prediction on this device. */
  predictions: { [source: string]: number };
  /** Bar fill 0..100 for the actual bytes (or the prediction while actual is unknown), on
   * ``scale``: every loaded model's bars share it, so a bar's length means bytes. */
  fillPct: number;
  /** The bytes a full bar stands for (the same for every bar; see ``memoryScale``). */
  scale: number;
  markers: IMarker[];
  /** (predicted - actual) / actual in percent; null without both. */
  errorPct: number | null;
  /** Share of the device's budget (or total) the model holds, in percent. */
  sharePct: number | null;
  capacity: number | null;
  capacityKind: 'budget' | 'total' | null;
  /** Plain words for the line beside the bar. */
  text: string;
}

export interface ILoadedRow {
  name: string;
  state: string;
  pid: number | null;
  size: number;
  sizeVram: number;
  context: number | null;
  /** GPU layers as words: ``N/M``, ``0 (CPU only)``, ``?``. */
  layers: string;
  refcount: number;
  pinned: boolean;
  keepAlive: IKeepAlive;
  devices: IDeviceMemory[];
  hasActual: boolean;
  /** Who holds it, on a manager shared through a JupyterHub (see ``peopleOf``). */
  people: IPeople | null;
}

/** Per device: total, free, budget, what loaded models use, what is left to plan with. */
export interface IDeviceRow {
  device: string;
  name: string;
  total: number;
  free: number;
  budget: number | null;
  overhead: number;
  used: number;
  /** From the scheduler; null when none runs. */
  available: number | null;
  capacity: number;
  capacityKind: 'budget' | 'total';
  usedPct: number;
  /** ``ready``; ``unreachable`` (a worker that did not answer); ``held`` (a worker in use by one model). */
  state: 'ready' | 'unreachable' | 'held';
  /** The model holding a held worker. */
  heldBy: string | null;
  text: string;
}

function deviceRoom(devices: IDevices | null | undefined): Map<string, IDeviceRow> {
  const used = new Map<string, number>();
  for (const lo of devices?.loaded ?? []) {
    for (const [d, n] of Object.entries(lo.by_device ?? {})) {
      used.set(d, (used.get(d) ?? 0) + (Number(n) || 0));
    }
  }
  const out = new Map<string, IDeviceRow>();
  for (const d of devices?.devices ?? []) {
    const id = d.id;
    const total = Number(d.total) || 0;
    const free = Number(d.free) || 0;
    const budget =
      d.budget === null || d.budget === undefined ? null : Number(d.budget);
    const overhead = id === 'cpu' ? 0 : Number(d.overhead) || 0;
    const u = used.get(id) ?? 0;
    const capacity = budget !== null ? budget : total;
    // The scheduler's figure, never recomputed here (one fit computation, on the server).
    const available = d.available === null || d.available === undefined ? null : Number(d.available);
    const capacityKind = budget !== null ? 'budget' : 'total';
    const state: IDeviceRow['state'] =
      d.reachable === false ? 'unreachable' : d.held_by ? 'held' : 'ready';
    const heldBy = d.held_by ?? null;
    let words: string;
    if (state === 'unreachable') {
      words = `unreachable: ${d.error || 'the worker did not answer'} · left out of placement`;
    } else {
      words =
        `${formatBytes(free)} free` +
        (budget !== null ? ` · budget ${formatBytes(budget)}` : ' · no budget') +
        (overhead ? ` · ${formatBytes(overhead)} kept free` : '') +
        (state === 'held'
          ? ` · in use by ${heldBy} (figures from before it loaded; a worker serves one model at a time)`
          : available !== null
            ? ` · ${formatBytes(available)} left to plan with`
            : '');
    }
    out.set(id, {
      device: id,
      name: d.name || id,
      total,
      free,
      budget,
      overhead,
      used: u,
      available,
      capacity,
      capacityKind,
      usedPct: capacity > 0 ? Math.min(100, (100 * u) / capacity) : 0,
      state,
      heldBy,
      text: words
    });
  }
  return out;
}

/** One row per device of ``api/devices``, GPUs first. */
export function deviceRows(devices: IDevices | null | undefined): IDeviceRow[] {
  const room = deviceRoom(devices);
  return deviceOrder(room.keys()).map(d => room.get(d)!);
}

const PREDICTION_ORDER = [DETAILED, COARSE, LLAMA_CPP];

/** Round steps for a scale's end, in its unit (KiB, MiB or GiB). */
const NICE_STEPS = [1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10];

/** The smallest round figure of bytes above ``bytes`` (``13.2 MiB`` -> ``15 MiB``, ``4 GiB``
 * -> ``5 GiB``), so a scale's end reads as a plain number and the longest bar never looks
 * like a full one; at least 1 KiB. */
export function niceBytes(bytes: number): number {
  const b = Math.max(KiB, Number(bytes) || 0);
  const unit = b >= GiB ? GiB : b >= MiB ? MiB : KiB;
  const v = b / unit;
  const decade = 10 ** Math.floor(Math.log10(v));
  const step = NICE_STEPS.find(k => k * decade > v * (1 + 1e-9)) ?? 10;
  return step * decade * unit;
}

/** A round figure of bytes without trailing zeros: ``15 MiB``, ``1.5 GiB``, ``512 KiB``. */
export function roundBytesText(bytes: number): string {
  const unit = bytes >= GiB ? GiB : bytes >= MiB ? MiB : KiB;
  const name = unit === GiB ? 'GiB' : unit === MiB ? 'MiB' : 'KiB';
  return `${Number((bytes / unit).toFixed(2))} ${name}`;
}

/**
 * The one scale every loaded model's memory bars share: the largest figure a bar shows
 * (a model's actual bytes on one device, or its main prediction while the actual figure is
 * not known, or where it is larger), rounded up to a round number. On one scale a bar's
 * length is bytes: a small model's bar is short beside a large one's, and no bar reads as
 * "nearly full" of itself. A prediction far past it (the coarse one's batch surcharge) is
 * marked at the end as off the scale rather than stretching every bar. Null when no
 * model is loaded.
 */
export function memoryScale(rows: ILoadedRow[]): number | null {
  const first = rows.find(r => r.devices.length)?.devices[0];
  return first ? first.scale : null;
}

/** The words that say what the bars' scale is, for the line above them. */
export function memoryScaleText(rows: ILoadedRow[]): string | null {
  const scale = memoryScale(rows);
  if (scale === null) {
    return null;
  }
  return `Memory bars share one scale, 0 to ${roundBytesText(scale)}: a bar's length is bytes.`;
}

function clampPct(v: number): number {
  return Math.min(100, Math.max(0, v));
}

/** One row per loaded model of ``api/ps``: memory per device (actual, predictions), layers,
 * context, requests in flight, keep-alive; on a shared manager, who holds it as ``me`` may
 * see it. */
export function loadedRows(
  ps: IPs | null | undefined,
  devices: IDevices | null | undefined,
  now: number,
  me?: IMe | null
): ILoadedRow[] {
  const room = deviceRoom(devices);
  const rows: ILoadedRow[] = [];
  let largest = 0;
  for (const m of ps?.models ?? []) {
    const mem = m.memory ?? {};
    const actualReport = mem[ACTUAL];
    const actual = reportByDevice(actualReport);
    const preds: { [src: string]: { [dev: string]: number } } = {};
    for (const src of PREDICTION_ORDER) {
      if (mem[src]) {
        preds[src] = reportByDevice(mem[src]);
      }
    }
    const devs = deviceOrder([
      ...Object.keys(actual),
      ...Object.values(preds).flatMap(p => Object.keys(p))
    ]);
    const perDevice: IDeviceMemory[] = devs.map(dev => {
      const a = actualReport ? (actual[dev] ?? 0) : null;
      const p: { [src: string]: number } = {};
      for (const [src, v] of Object.entries(preds)) {
        p[src] = v[dev] ?? 0;
      }
      const mainSource =
        PREDICTION_ORDER.find(src => p[src] !== undefined) ?? null;
      const main = mainSource !== null ? p[mainSource] : null;
      // what the scale must hold: the actual figure and the main prediction
      largest = Math.max(largest, a ?? 0, main ?? 0);
      const markers: IMarker[] = PREDICTION_ORDER.filter(src => p[src] !== undefined).map(src => ({
        source: src,
        bytes: p[src],
        pct: 0, // placed below, once the shared scale is known
        offScale: false
      }));
      const r = room.get(dev);
      const capacity = r ? r.capacity : null;
      const capacityKind = r ? r.capacityKind : null;
      const held = a !== null ? a : (main ?? 0);
      const errorPct = a && main !== null ? (100 * (main - a)) / a : null;
      const sharePct = capacity ? (100 * held) / capacity : null;
      const words: string[] = [
        a !== null ? `actual ${formatBytes(a)}` : 'actual: not yet known'
      ];
      if (mainSource !== null && main !== null) {
        let w = `predicted ${formatBytes(main)} (${mainSource}`;
        if (errorPct !== null) {
          w += `, ${signedPct(errorPct)}`;
        }
        words.push(w + ')');
      }
      for (const src of PREDICTION_ORDER) {
        if (src !== mainSource && p[src] !== undefined) {
          words.push(`${src} ${formatBytes(p[src])}`);
        }
      }
      if (sharePct !== null && capacityKind !== null) {
        words.push(
          `${sharePct < 0.1 && sharePct > 0 ? '<0.1' : sharePct.toFixed(1)}% of the ${capacityKind}`
        );
      }
      return {
        device: dev,
        actual: a,
        predicted: main,
        predictedSource: mainSource,
        predictions: p,
        fillPct: 0, // placed below, once the shared scale is known
        scale: 0,
        markers,
        errorPct,
        sharePct,
        capacity,
        capacityKind,
        text: words.join(' · ')
      };
    });
    const lo = m.layers_offloaded;
    const lt = m.layers_total;
    let layers: string;
    if (lo !== null && lo !== undefined && lt) {
      layers = `${lo}/${lt}`;
    } else if ((Number(m.size_vram) || 0) === 0) {
      layers = lt ? `0/${lt}` : '0 (CPU only)';
    } else {
      layers = '?';
    }
    const opts = m.options ?? {};
    const ctx =
      Number(m.context_length) || Number(opts['num_ctx'] as number) || null;
    rows.push({
      name: m.name || m.model || '',
      state: m.state || 'ready',
      pid: m.pid ?? null,
      size: Number(m.size) || 0,
      sizeVram: Number(m.size_vram) || 0,
      context: ctx,
      layers,
      refcount: Number(m.refcount) || 0,
      pinned: !!m.pinned,
      keepAlive: keepAlive(m, now),
      devices: perDevice,
      hasActual: !!actualReport,
      people: peopleOf(m, me)
    });
  }
  // One scale for every bar (see memoryScale): a bar's length is bytes, across models and devices.
  const scale = niceBytes(largest);
  for (const d of rows.flatMap(r => r.devices)) {
    d.scale = scale;
    d.fillPct = clampPct((100 * (d.actual !== null ? d.actual : (d.predicted ?? 0))) / scale);
    for (const mk of d.markers) {
      const pct = (100 * mk.bytes) / scale;
      mk.pct = clampPct(pct);
      mk.offScale = pct > 100;
    }
  }
  return rows;
}

// ---------------------------------------------------------------- decisions

export interface IEventRow {
  seq: number;
  time: string;
  kind: string;
  model: string;
  message: string;
}

/** ``HH:MM:SS`` in local time for epoch seconds. */
export function clockText(epochSeconds: number): string {
  const d = new Date(epochSeconds * 1000);
  const pad = (v: number) => String(v).padStart(2, '0');
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

/** The latest ``limit`` scheduler decisions, newest first. */
export function eventRows(
  events: IEvent[] | null | undefined,
  limit = 8
): IEventRow[] {
  const sorted = [...(events ?? [])].sort(
    (a, b) => (a.seq ?? 0) - (b.seq ?? 0)
  );
  return sorted
    .slice(Math.max(0, sorted.length - limit))
    .reverse()
    .map(e => ({
      seq: e.seq ?? 0,
      time: typeof e.time === 'number' ? clockText(e.time) : '',
      kind: e.kind ?? '',
      model: e.model ?? '',
      message: e.message ?? ''
    }));
}

// ---------------------------------------------------------------- status bar

export interface IStatusSummary {
  loaded: number;
  /** Short words for the status bar. */
  text: string;
  /** Longer words for its tooltip: one line per device. */
  title: string;
}

/** Number of loaded models and memory in use against the budget, for the status bar. */
export function statusSummary(
  ps: IPs | null | undefined,
  devices: IDevices | null | undefined
): IStatusSummary {
  const n = (ps?.models ?? []).length;
  const rows = deviceRows(devices);
  // The device that matters most: the accelerator loaded models use most (a local GPU before
  // an RPC worker when both are idle), else host memory; never a worker that does not answer.
  const accel = rows.filter(r => r.device !== 'cpu' && r.state !== 'unreachable');
  const busiest = accel.reduce<IDeviceRow | undefined>((best, r) => (best && best.used >= r.used ? best : r), undefined);
  const main =
    (busiest && busiest.used > 0 ? busiest : accel.find(r => !r.device.startsWith('rpc:')) ?? accel[0]) ??
    rows.find(r => r.device === 'cpu') ??
    rows[0];
  let text = `Llama: ${plural(n, 'model')}`;
  if (main) {
    text += ` · ${formatBytesShort(main.used)} / ${formatBytesShort(main.capacity)}`;
    if (rows.length > 1) {
      text += ` ${main.device}`;
    }
  }
  const lines = [`${plural(n, 'model')} loaded`];
  for (const r of rows) {
    lines.push(
      `${r.device} (${r.name}): ${formatBytes(r.used)} used by loaded models of ` +
        `${formatBytes(r.capacity)} (${r.capacityKind}); ${r.text}`
    );
  }
  lines.push('Click to open the Llama panel.');
  return { loaded: n, text, title: lines.join('\n') };
}

// ---------------------------------------------------------------- pull progress

export interface IPullProgress {
  /** 0..1 when the size is known, else null (an indeterminate bar). */
  fraction: number | null;
  text: string;
  done: boolean;
  error: string | null;
}

/** How fast a download goes and when it ends, as ``TransferRate.add`` measures it. */
export interface ITransferRate {
  /** Bytes per second over the latest few seconds; null until there is enough to tell. */
  bytesPerSecond: number | null;
  /** Seconds until the file is complete at that speed; null when unknown. */
  secondsLeft: number | null;
}

/**
 * The speed and time left of a pull, from its ``completed`` bytes over time: the bytes gained
 * over the latest ``windowSeconds`` divided by the time they took. A new file (another
 * ``digest`` or status text) or a count that goes back (a download started again) starts the
 * measure afresh. Nothing is said before ``minSeconds`` of samples, so a first burst does not
 * read as the speed.
 */
export class TransferRate {
  constructor(
    readonly windowSeconds = 8,
    readonly minSeconds = 1
  ) {}

  /** Record ``completed`` of ``total`` bytes of file ``key`` at ``now`` (seconds). */
  add(now: number, key: string, completed: number, total: number): ITransferRate {
    if (key !== this._key || (this._samples.length && completed < this._samples[this._samples.length - 1][1])) {
      this._key = key;
      this._samples = [];
    }
    this._samples.push([now, completed]);
    while (this._samples.length > 2 && now - this._samples[1][0] >= this.windowSeconds) {
      this._samples.shift();
    }
    const [t0, c0] = this._samples[0];
    const span = now - t0;
    if (span < this.minSeconds) {
      return { bytesPerSecond: null, secondsLeft: null };
    }
    const speed = Math.max(0, completed - c0) / span;
    const left = total > completed && speed > 0 ? (total - completed) / speed : null;
    return { bytesPerSecond: speed, secondsLeft: left };
  }

  private _key: string | null = null;
  private _samples: [number, number][] = [];
}

/** ``12.3 MiB/s · about 1m 05s left`` (what is known of it), or ''. */
export function rateText(rate: ITransferRate | null | undefined): string {
  if (!rate || rate.bytesPerSecond === null) {
    return '';
  }
  const parts = [`${formatBytes(rate.bytesPerSecond)}/s`];
  if (rate.secondsLeft !== null) {
    parts.push(`about ${durationText(rate.secondsLeft)} left`);
  } else if (rate.bytesPerSecond === 0) {
    parts.push('stalled');
  }
  return parts.join(' · ');
}

/**
 * A failed pull's message for a line that already names ``source``: the source is not said
 * again, nor a second HTTP status after the remote server's, and a file the remote server
 * does not have is said in one sentence (``nothing is at this address (HTTP 404 not
 * found).``; a file other than the source, as one a Hugging Face repository lists, is named).
 */
export function pullErrorText(source: string, message: string): string {
  let msg = String(message ?? '').trim();
  const src = String(source ?? '').trim();
  // errorMessage's "(HTTP n)", this server's status, after a message that gives the remote
  // server's own: the remote one is what the person needs
  const tail = /\s*\(HTTP \d{3}\)$/.exec(msg);
  if (tail && /\bHTTP \d{3}\b/.test(msg.slice(0, tail.index))) {
    msg = msg.slice(0, tail.index);
  }
  const notFound = /^(\S+): not found \(HTTP (404|410)\b[^)]*\)\.?$/.exec(msg);
  if (notFound) {
    const [, where, status] = notFound;
    return where === src
      ? `nothing is at this address (HTTP ${status} not found).`
      : `the server has no file ${where} (HTTP ${status} not found).`;
  }
  if (src && msg.startsWith(`${src}: `)) {
    msg = msg.slice(src.length + 2);
  }
  return msg;
}

/** One pull status line -> what the progress bar shows; ``rate``: its speed, when known. */
export function pullProgress(st: IPullStatus, rate?: ITransferRate | null): IPullProgress {
  if (st.error) {
    return { fraction: null, text: st.error, done: true, error: st.error };
  }
  const status = st.status ?? '';
  if (status === 'success') {
    return {
      fraction: 1,
      text: st.model ? `success: ${st.model}` : 'success',
      done: true,
      error: null
    };
  }
  const total = Number(st.total) || 0;
  if (total > 0) {
    const done = Math.min(total, Math.max(0, Number(st.completed) || 0));
    const frac = done / total;
    const speed = rateText(rate);
    return {
      fraction: frac,
      text:
        `${status}: ${formatBytes(done)} / ${formatBytes(total)} (${Math.floor(frac * 100)}%)` +
        (speed ? ` · ${speed}` : ''),
      done: false,
      error: null
    };
  }
  return { fraction: null, text: status, done: false, error: null };
}

/**
 * Splits a byte stream of newline-delimited JSON into objects. ``push`` returns the
 * complete lines so far; ``end`` returns what a last unterminated line holds.
 */
export class NdjsonSplitter {
  private _buffer = '';

  push(text: string): unknown[] {
    this._buffer += text;
    const parts = this._buffer.split('\n');
    this._buffer = parts.pop() ?? '';
    return parts.filter(p => p.trim()).map(p => JSON.parse(p));
  }

  end(): unknown[] {
    const rest = this._buffer.trim();
    this._buffer = '';
    return rest ? [JSON.parse(rest)] : [];
  }
}

// ---------------------------------------------------------------- help text

/** Help text with ``code`` spans between backticks, as parts: ``[{text, code}]`` (an odd
 * backtick is kept as it is). */
export function codeSpans(text: string): { text: string; code: boolean }[] {
  const parts = String(text ?? '').split('`');
  if (parts.length % 2 === 0) {
    // an unmatched backtick: the last one is literal
    parts.splice(parts.length - 2, 2, `${parts[parts.length - 2]}\`${parts[parts.length - 1]}`);
  }
  return parts.map((t, i) => ({ text: t, code: i % 2 === 1 })).filter(p => p.text !== '');
}

// ---------------------------------------------------------------- polling policy

export interface IPollFrequency {
  interval: number;
  backoff: number;
  max: number;
}

export const MIN_INTERVAL_S = 1;
export const MAX_INTERVAL_S = 600;

/**
 * The ``@lumino/polling`` frequency for a refresh interval in seconds: clamped to
 * [1 s, 10 min]; after failures the interval doubles up to 30 times itself, at most
 * 5 minutes (and never below the interval).
 */
export function pollFrequency(intervalSeconds: number): IPollFrequency {
  let s = Number(intervalSeconds);
  if (!Number.isFinite(s) || s <= 0) {
    s = 3;
  }
  s = Math.min(MAX_INTERVAL_S, Math.max(MIN_INTERVAL_S, s));
  const interval = Math.round(s * 1000);
  return {
    interval,
    backoff: 2,
    max: Math.max(interval, Math.min(interval * 30, 300_000))
  };
}

/**
 * Decides which failures become notifications, so a server that is down does not
 * produce one per poll: a failure is reported when it is the first after a success
 * or its message changed; ``success()`` re-arms it and says whether to announce
 * the recovery.
 */
export class ErrorGate {
  private _last: string | null = null;

  get failing(): boolean {
    return this._last !== null;
  }

  get message(): string | null {
    return this._last;
  }

  /** Record a failure; true when it should be shown. */
  fail(message: string): boolean {
    const show = this._last !== message;
    this._last = message;
    return show;
  }

  /** Record a success; true when it ends a run of failures. */
  success(): boolean {
    const recovered = this._last !== null;
    this._last = null;
    return recovered;
  }
}

/** The message of an API error body (``{"error": "..."}``, or OpenAI's nested form). */
export function errorMessage(body: unknown, status?: number): string {
  let msg = '';
  if (body && typeof body === 'object') {
    const err = (body as { error?: unknown; message?: unknown }).error;
    if (typeof err === 'string') {
      msg = err;
    } else if (err && typeof err === 'object' && 'message' in err) {
      msg = String((err as { message: unknown }).message);
    } else if (typeof (body as { message?: unknown }).message === 'string') {
      msg = (body as { message: string }).message;
    }
  } else if (typeof body === 'string') {
    msg = body.trim().split('\n')[0];
  }
  if (!msg) {
    msg = 'request failed';
  }
  return status && status >= 400 ? `${msg} (HTTP ${status})` : msg;
}
