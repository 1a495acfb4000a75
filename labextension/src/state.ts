/**
 * What the panel and the status bar show, kept fresh by one ``@lumino/polling`` Poll
 * (backs off after failures, stands by while the page is hidden), and the actions
 * (load, unload, pull) that change it. Failures become notifications, once per outage.
 */
import { Notification } from '@jupyterlab/apputils';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { LlamaApi } from './api';
import { PresetCache } from './presets';
import {
  ErrorGate,
  IDevices,
  IEvent,
  IMe,
  IPs,
  IPullProgress,
  ITags,
  TransferRate,
  hasPeople,
  pollFrequency,
  pullErrorText,
  pullProgress
} from './model';

export interface IPullState extends IPullProgress {
  source: string;
  running: boolean;
}

export class LlamaState {
  constructor(
    readonly api: LlamaApi,
    intervalSeconds = 3
  ) {
    this.presets = new PresetCache({
      show: name => this.api.show(name),
      changed: () => {
        if (!this._disposed) {
          this._changed.emit();
        }
      }
    });
    this._poll = new Poll({
      name: 'jupyter-llama:state',
      factory: () => this._update(),
      frequency: pollFrequency(intervalSeconds),
      standby: 'when-hidden',
      auto: true
    });
  }

  /** The registered models' presets: ``api/show`` once per model and digest (see ./presets). */
  readonly presets: PresetCache;

  ps: IPs | null = null;
  tags: ITags | null = null;
  devices: IDevices | null = null;
  events: IEvent[] = [];
  /** Who this page's user is to a manager shared through a JupyterHub (``api/me``), read once
   * the first ``ps`` entry says who holds it; null before, and on a single user's manager. */
  me: IMe | null = null;
  /** The latest failure to reach the API, shown in the panel while it lasts. */
  error: string | null = null;
  /** Epoch seconds of the latest successful update. */
  updatedAt: number | null = null;
  /** Models with a load or unload in progress from this page. */
  readonly busy = new Map<string, 'loading' | 'unloading'>();
  pull: IPullState | null = null;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** Set the refresh interval (seconds; the settings' ``refreshInterval``). */
  setInterval(seconds: number): void {
    this._poll.frequency = pollFrequency(seconds);
  }

  /** Whether the registry list is read on every tick (while the panel is visible). */
  set wantTags(value: boolean) {
    const was = this._wantTags;
    this._wantTags = value;
    if (value && !was) {
      void this.refresh();
    }
  }

  /** Update now (and restart the interval). */
  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  async load(name: string): Promise<void> {
    await this._act(name, 'loading', () => this.api.load(name));
  }

  async unload(name: string): Promise<void> {
    await this._act(name, 'unloading', () => this.api.unload(name));
  }

  async pullModel(source: string, destination?: string): Promise<void> {
    source = source.trim();
    if (!source || this.pull?.running) {
      return;
    }
    this.pull = { source, running: true, fraction: null, text: 'starting…', done: false, error: null };
    this._changed.emit();
    const rate = new TransferRate(); // speed and time left, from the bytes completed over time
    try {
      const last = await this.api.pull(
        source,
        st => {
          const total = Number(st.total) || 0;
          const speed = total > 0
            ? rate.add(performance.now() / 1000, st.digest || st.status || '', Number(st.completed) || 0, total)
            : null;
          this.pull = { ...pullProgress(st, speed), source, running: true };
          this._changed.emit();
        },
        destination?.trim() || undefined
      );
      this.pull = { ...pullProgress(last.status ? last : { status: 'success' }), source, running: false };
      Notification.success(`Pulled ${source}`, { autoClose: 5000 });
      this._tagsStale = true;
    } catch (e) {
      // the panel's line and the notification name the source already: said once
      const msg = pullErrorText(source, (e as Error).message ?? String(e));
      this.pull = { source, running: false, fraction: null, text: msg, done: true, error: msg };
      Notification.error(`Pull of ${source} failed: ${msg}`, { autoClose: 10000 });
    }
    this._changed.emit();
    await this.refresh();
  }

  /** Forget a finished pull's status (the panel's × button). */
  clearPull(): void {
    if (this.pull && !this.pull.running) {
      this.pull = null;
      this._changed.emit();
    }
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._poll.dispose();
    this.presets.dispose();
    Signal.clearData(this);
  }

  private async _act(
    name: string,
    what: 'loading' | 'unloading',
    call: () => Promise<unknown>
  ): Promise<void> {
    if (this.busy.has(name)) {
      return;
    }
    this.busy.set(name, what);
    this._changed.emit();
    // The scheduler shows the loading state in ps at once: refresh while it works.
    const early = setTimeout(() => void this.refresh(), 300);
    try {
      await call(); // the panel shows the result: no toast for success
    } catch (e) {
      const verb = what === 'loading' ? 'Load' : 'Unload';
      Notification.error(`${verb} of ${name} failed: ${(e as Error).message ?? e}`, {
        autoClose: 10000
      });
    } finally {
      clearTimeout(early);
      this.busy.delete(name);
      this._changed.emit();
      await this.refresh();
    }
  }

  private async _update(): Promise<void> {
    try {
      const readTags = this._wantTags || this._tagsStale || this.tags === null;
      const [ps, devices, events, tags] = await Promise.all([
        this.api.ps(),
        this.api.devices(),
        this.api.events(20).catch(() => this.events), // the panel works without them
        readTags ? this.api.tags() : Promise.resolve(this.tags)
      ]);
      if (!this._meAsked && (ps.models ?? []).some(hasPeople)) {
        // A shared manager: whether this user administers it decides what they may unload.
        // Asked once; without an answer the ps entries' own shape tells (see peopleOf).
        this._meAsked = true;
        this.me = await this.api.me().catch(() => null);
      }
      if (this._disposed) {
        return;
      }
      this.ps = ps;
      this.devices = devices;
      this.events = events;
      this.tags = tags;
      if (readTags) {
        this.presets.update(tags); // show calls only for new models and changed digests
      }
      this._tagsStale = false;
      this.error = null;
      this.updatedAt = Date.now() / 1000;
      if (this._gate.success()) {
        Notification.info('jupyter-llama: the server answers again', { autoClose: 3000 });
      }
      this._changed.emit();
    } catch (e) {
      const msg = (e as Error).message ?? String(e);
      this.error = msg;
      if (this._gate.fail(msg)) {
        Notification.error(`jupyter-llama: ${msg}`, { autoClose: 10000 });
      }
      this._changed.emit();
      throw e; // the Poll backs off
    }
  }

  private _poll: Poll;
  private _changed = new Signal<this, void>(this);
  private _gate = new ErrorGate();
  private _wantTags = false;
  private _tagsStale = true;
  private _meAsked = false;
  private _disposed = false;
}
