/**
 * The registered models' presets, for the panel's rows. ``api/tags`` does not carry them
 * (it keeps Ollama's shape), so ``api/show`` is asked once per model and manifest digest:
 * when a model first appears or its digest changes (a new preset makes a new manifest),
 * never on every poll. A failed ``show`` leaves that model's line out and is asked again
 * only after ``retryMs``.
 *
 * No DOM and no JupyterLab here (``show`` is handed in), so it is unit-tested in Node.
 */
import { IPresetSummary, IShow, ITags, presetSummary } from './model';

export interface IPresetCacheOptions {
  /** ``POST api/show`` for one model name. */
  show: (name: string) => Promise<IShow>;
  /** Called when a summary arrived that differs from what was known (the panel re-renders). */
  changed?: () => void;
  /** How long a failed ``show`` waits before it is asked again (ms; default 60 s). */
  retryMs?: number;
  /** The clock, in ms (tests). */
  now?: () => number;
}

interface IEntry {
  summary: IPresetSummary | null;
  /** When the show call failed (ms), else null. */
  failedAt: number | null;
}

/** The cache key: the manifest digest (two names of one manifest share it), else the name. */
export function presetKey(name: string, digest: string | null | undefined): string {
  return digest ? `digest:${digest}` : `name:${name.toLowerCase()}`;
}

export class PresetCache {
  constructor(options: IPresetCacheOptions) {
    this._show = options.show;
    this._changed = options.changed ?? (() => undefined);
    this._retryMs = options.retryMs ?? 60_000;
    this._now = options.now ?? (() => Date.now());
  }

  /** What ``show`` said of a registered model; null without a preset, or not (yet) known. */
  get(name: string, digest: string | null | undefined): IPresetSummary | null {
    return this._entries.get(presetKey(name, digest))?.summary ?? null;
  }

  /** How many show calls are under way. */
  get pending(): number {
    return this._inflight.size;
  }

  /**
   * Take a fresh ``api/tags``: ask ``show`` about each model not known by its digest yet
   * (in the background: this returns at once), forget models no longer listed.
   */
  update(tags: ITags | null | undefined): void {
    if (this._disposed || !tags) {
      return;
    }
    const wanted = new Map<string, string>(); // key -> the name to ask about
    for (const m of tags.models ?? []) {
      const name = m.name || m.model || '';
      if (name) {
        const key = presetKey(name, m.digest);
        if (!wanted.has(key)) {
          wanted.set(key, name);
        }
      }
    }
    this._wanted = new Set(wanted.keys());
    for (const key of Array.from(this._entries.keys())) {
      if (!wanted.has(key)) {
        this._entries.delete(key);
      }
    }
    const now = this._now();
    for (const [key, name] of wanted) {
      if (this._inflight.has(key)) {
        continue;
      }
      const known = this._entries.get(key);
      if (known && (known.failedAt === null || now - known.failedAt < this._retryMs)) {
        continue;
      }
      const call: Promise<void> = this._fetch(key, name).finally(() => {
        if (this._inflight.get(key) === call) {
          this._inflight.delete(key);
        }
      });
      this._inflight.set(key, call);
    }
  }

  /** Resolves when the show calls under way have finished (tests). */
  async settled(): Promise<void> {
    while (this._inflight.size) {
      await Promise.all(Array.from(this._inflight.values()));
    }
  }

  dispose(): void {
    this._disposed = true;
    this._entries.clear();
  }

  private async _fetch(key: string, name: string): Promise<void> {
    let entry: IEntry;
    try {
      entry = { summary: presetSummary(await this._show(name)), failedAt: null };
    } catch {
      entry = { summary: null, failedAt: this._now() };
    }
    if (this._disposed || !this._wanted.has(key)) {
      return; // the model went away (or changed) while show was under way
    }
    const before = this._entries.get(key)?.summary ?? null;
    this._entries.set(key, entry);
    if (JSON.stringify(before) !== JSON.stringify(entry.summary)) {
      try {
        this._changed();
      } catch {
        // a listener's failure is not the cache's
      }
    }
  }

  private _show: (name: string) => Promise<IShow>;
  private _changed: () => void;
  private _retryMs: number;
  private _now: () => number;
  private _entries = new Map<string, IEntry>();
  private _inflight = new Map<string, Promise<void>>();
  private _wanted = new Set<string>();
  private _disposed = false;
}
