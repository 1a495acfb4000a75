/**
 * The "Llama" side panel: device totals, loaded models with their memory bars,
 * registered models with Load / Unload, a Pull box, the scheduler's latest decisions.
 * Thin: every number and word comes from ./model; this file only lays them out.
 */
import { Widget } from '@lumino/widgets';
import { Message } from '@lumino/messaging';

import { h, withCode } from './dom';
import { llamaIcon } from './icon';
import {
  COARSE,
  DETAILED,
  IDeviceMemory,
  IDeviceRow,
  ILoadedRow,
  IModelRow,
  IPeople,
  LLAMA_CPP,
  clockText,
  countdownText,
  deviceRows,
  eventRows,
  formatBytesShort as fmtShort,
  loadedRows,
  memoryScale,
  memoryScaleText,
  modelRows,
  plural,
  roundBytesText
} from './model';
import { LlamaState } from './state';

const SOURCE_SHORT: { [src: string]: string } = {
  [DETAILED]: 'detailed',
  [COARSE]: 'coarse',
  [LLAMA_CPP]: 'llama.cpp'
};

const SOURCE_LABEL: { [src: string]: string } = {
  [DETAILED]: 'detailed prediction',
  [COARSE]: 'coarse prediction',
  [LLAMA_CPP]: "llama.cpp's projection"
};

/** Whether the manager lets this page's user unload a loaded model (always, on a single user's). */
function mayUnload(people: IPeople | null): boolean {
  return people === null || people.mayUnload;
}

/** An Unload button's tooltip: ``title``, or why this user may not unload the model. */
function unloadTitle(name: string, people: IPeople | null, title: string): string {
  return people?.refusal ? `You cannot unload ${name}: ${people.refusal}.` : title;
}

export class LlamaPanel extends Widget {
  constructor(readonly state: LlamaState) {
    super();
    this.id = 'jupyter-llama-panel';
    this.addClass('jp-Llama-panel');
    this.title.icon = llamaIcon;
    this.title.caption = 'Llama: models and memory';

    this._status = h('div', { class: 'jp-Llama-status' });
    this._devices = h('div', { class: 'jp-Llama-section-body', 'data-section': 'devices' });
    this._loaded = h('div', { class: 'jp-Llama-section-body', 'data-section': 'loaded' });
    this._models = h('div', { class: 'jp-Llama-section-body', 'data-section': 'models' });
    this._events = h('div', { class: 'jp-Llama-section-body', 'data-section': 'events' });
    this._loadedTitle = h('h3', { class: 'jp-Llama-section-title' }, 'Loaded models');

    this._pullSource = h('input', {
      class: 'jp-Llama-input',
      type: 'text',
      placeholder: 'llama3.2:1b, hf.co/owner/repo:quant or a URL',
      'aria-label': 'model to pull',
      onkeydown: (ev: Event) => {
        if ((ev as KeyboardEvent).key === 'Enter') {
          this._startPull();
        }
      }
    }) as HTMLInputElement;
    this._pullName = h('input', {
      class: 'jp-Llama-input jp-Llama-input-name',
      type: 'text',
      placeholder: 'name (optional)',
      'aria-label': 'name for the pulled model'
    }) as HTMLInputElement;
    this._pullButton = h(
      'button',
      { class: 'jp-Llama-button jp-mod-accent', onclick: () => this._startPull() },
      'Pull'
    ) as HTMLButtonElement;
    this._pullBar = h('div', { class: 'jp-Llama-bar-fill jp-Llama-pull-fill' });
    this._pullText = h('div', { class: 'jp-Llama-muted jp-Llama-pull-text' });
    this._pullClear = h(
      'button',
      {
        class: 'jp-Llama-icon-button jp-Llama-pull-clear',
        title: 'Clear',
        'aria-label': 'clear the pull status',
        onclick: () => this.state.clearPull()
      },
      '×'
    ) as HTMLButtonElement;
    this._pullProgress = h(
      'div',
      { class: 'jp-Llama-pull-progress', hidden: true },
      h('div', { class: 'jp-Llama-bar' }, this._pullBar),
      h('div', { class: 'jp-Llama-row-head' }, this._pullText, this._pullClear)
    );

    const refresh = h(
      'button',
      {
        class: 'jp-Llama-icon-button',
        title: 'Refresh now',
        'aria-label': 'refresh',
        onclick: () => void this.state.refresh()
      },
      '⟳'
    );

    this.node.appendChild(
      h(
        'div',
        { class: 'jp-Llama-content' },
        h(
          'header',
          { class: 'jp-Llama-header' },
          h('h2', { class: 'jp-Llama-title' }, 'Llama'),
          refresh
        ),
        this._status,
        h('h3', { class: 'jp-Llama-section-title' }, 'Devices'),
        this._devices,
        this._loadedTitle,
        this._loaded,
        h('h3', { class: 'jp-Llama-section-title' }, 'Registered models'),
        this._models,
        h('h3', { class: 'jp-Llama-section-title' }, 'Pull a model'),
        h(
          'div',
          { class: 'jp-Llama-section-body' },
          this._pullSource,
          h('div', { class: 'jp-Llama-pull-row' }, this._pullName, this._pullButton),
          this._pullProgress
        ),
        h('h3', { class: 'jp-Llama-section-title' }, 'Scheduler decisions'),
        this._events
      )
    );
    state.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._stopTicker();
    this.state.wantTags = false;
    this.state.changed.disconnect(this._render, this);
    super.dispose();
  }

  /** Focus the pull box (the palette's "pull" command with no argument). */
  focusPull(): void {
    this._pullSource.focus();
  }

  protected onAfterShow(msg: Message): void {
    this.state.wantTags = true;
    this._startTicker();
    this._render();
  }

  protected onAfterAttach(msg: Message): void {
    if (this.isVisible) {
      this.state.wantTags = true;
      this._startTicker();
    }
  }

  protected onBeforeHide(msg: Message): void {
    this.state.wantTags = false;
    this._stopTicker();
  }

  protected onBeforeDetach(msg: Message): void {
    this.state.wantTags = false;
    this._stopTicker();
  }

  // ------------------------------------------------------------------ rendering

  private _render(): void {
    const s = this.state;
    const now = Date.now() / 1000;

    let status = s.updatedAt !== null ? `updated ${clockText(s.updatedAt)}` : 'connecting…';
    this._status.classList.toggle('jp-mod-error', !!s.error);
    if (s.error) {
      status = `cannot update: ${s.error}`;
    }
    this._status.textContent = status;

    const devs = deviceRows(s.devices);
    this._section(this._devices, devs, () => this._renderDevices(devs));

    const loaded = loadedRows(s.ps, s.devices, now, s.me);
    this._loadedTitle.textContent = `Loaded models (${loaded.length})`;
    // The countdown ticks on its own; the rest only re-renders when it changed.
    const loadedKey = loaded.map(r => ({ ...r, keepAlive: r.keepAlive.expiresAt ?? r.keepAlive.text, busy: s.busy.get(r.name) ?? null }));
    this._section(this._loaded, loadedKey, () => this._renderLoaded(loaded));

    const models = modelRows(s.tags, s.ps, (name, digest) => s.presets.get(name, digest), s.me);
    const modelsKey = models.map(m => ({ ...m, busy: s.busy.get(m.name) ?? null }));
    this._section(this._models, modelsKey, () => this._renderModels(models));

    const events = eventRows(s.events, 8);
    this._section(this._events, events, () => this._renderEvents(events));

    this._renderPull();
  }

  /** Rebuild ``el`` only when ``key`` changed (a click is never lost to a needless redraw). */
  private _section(el: HTMLElement, key: unknown, build: () => Node[]): void {
    const sig = JSON.stringify(key);
    if (this._sigs.get(el) === sig) {
      return;
    }
    this._sigs.set(el, sig);
    el.replaceChildren(...build());
  }

  private _bar(pct: number, cls: string, title: string, markers: Node[] = []): HTMLElement {
    return h(
      'div',
      { class: 'jp-Llama-bar', title },
      h('div', { class: `jp-Llama-bar-fill ${cls}`, style: `width:${pct.toFixed(2)}%` }),
      ...markers
    );
  }

  private _renderDevices(rows: IDeviceRow[]): Node[] {
    if (!rows.length) {
      return [h('div', { class: 'jp-Llama-muted' }, 'no device information yet')];
    }
    return rows.map(r =>
      h(
        'div',
        { class: 'jp-Llama-device', 'data-device': r.device, 'data-state': r.state },
        h(
          'div',
          { class: 'jp-Llama-row-head' },
          h('span', { class: 'jp-Llama-device-id' }, r.device),
          h('span', { class: 'jp-Llama-right jp-Llama-nowrap' }, `${fmtShort(r.used)} / ${fmtShort(r.capacity)}`)
        ),
        r.budget !== null || r.state !== 'ready'
          ? h(
              'div',
              { class: 'jp-Llama-device-tags' },
              r.budget !== null ? h('span', { class: 'jp-Llama-tag' }, 'budget') : null,
              r.state === 'unreachable' ? h('span', { class: 'jp-Llama-tag jp-Llama-tag-error' }, 'unreachable') : null,
              r.state === 'held' ? h('span', { class: 'jp-Llama-tag' }, `in use by ${r.heldBy}`) : null
            )
          : null,
        this._bar(r.usedPct, 'jp-Llama-fill-device', `${r.usedPct.toFixed(1)}% of the ${r.capacityKind} in use by loaded models`),
        h('div', { class: 'jp-Llama-small jp-Llama-muted' }, `${r.name} · ${r.text}`)
      )
    );
  }

  private _renderLoaded(rows: ILoadedRow[]): Node[] {
    if (!rows.length) {
      return [h('div', { class: 'jp-Llama-muted jp-Llama-empty' }, 'No model is loaded.')];
    }
    const cards = rows.map(r => {
      const busy = this.state.busy.get(r.name);
      const ka = r.keepAlive;
      const keep =
        ka.expiresAt !== null
          ? h('span', { class: 'jp-Llama-countdown', 'data-expires': ka.expiresAt }, countdownText(ka.expiresAt, Date.now() / 1000))
          : h('span', { class: 'jp-Llama-countdown' }, ka.text);
      const facts = h(
        'dl',
        { class: 'jp-Llama-facts' },
        h('dt', null, 'GPU layers'),
        h('dd', null, r.layers),
        h('dt', null, 'context'),
        h('dd', null, r.context !== null ? String(r.context) : '-'),
        h('dt', null, 'in flight'),
        h('dd', null, plural(r.refcount, 'request')),
        h('dt', null, 'keep-alive'),
        h('dd', null, keep)
      );
      return h(
        'div',
        { class: 'jp-Llama-card', 'data-loaded-model': r.name, 'data-state': r.state },
        h(
          'div',
          { class: 'jp-Llama-row-head' },
          h('span', { class: 'jp-Llama-model-name' }, r.name),
          r.state !== 'ready' ? h('span', { class: `jp-Llama-tag jp-Llama-state-${r.state}` }, r.state) : null,
          r.pinned ? h('span', { class: 'jp-Llama-tag' }, 'pinned') : null,
          h(
            'button',
            {
              class: 'jp-Llama-button jp-Llama-right',
              'data-action': 'unload',
              disabled: !!busy || r.state === 'unloading' || !mayUnload(r.people),
              title: unloadTitle(r.name, r.people, `Unload ${r.name} (keep_alive 0)`),
              onclick: () => void this.state.unload(r.name)
            },
            busy === 'unloading' ? 'Unloading…' : 'Unload'
          )
        ),
        r.people?.text
          ? h(
              'div',
              { class: 'jp-Llama-small jp-Llama-muted jp-Llama-people', title: r.people.title },
              ...r.people.parts.flatMap((part, i) => [i ? ' · ' : null, h('span', { class: 'jp-Llama-nowrap' }, part)])
            )
          : null,
        facts,
        ...r.devices.map(d => this._renderDeviceMemory(d))
      );
    });
    const scale = memoryScale(rows);
    const scaleLine = scale !== null
      ? h(
          'div',
          {
            class: 'jp-Llama-scale jp-Llama-small jp-Llama-muted',
            'data-scale': scale,
            title: "Every model's bars are drawn on this scale, so bars compare as bytes; " +
              "each bar's words give its share of the device's budget or total."
          },
          memoryScaleText(rows)
        )
      : null;
    const present = new Set(rows.flatMap(r => r.devices.flatMap(d => d.markers.map(m => m.source))));
    const legend = h(
      'div',
      {
        class: 'jp-Llama-legend jp-Llama-small jp-Llama-muted',
        title: "bar: memory llama.cpp allocated (from its log); markers: predictions (an arrow at the end: off the bar's scale)"
      },
      h('span', { class: 'jp-Llama-swatch jp-Llama-fill-actual' }),
      'actual',
      ...[DETAILED, COARSE, LLAMA_CPP]
        .filter(src => present.has(src))
        .flatMap(src => [h('span', { class: `jp-Llama-swatch jp-Llama-marker-${src}` }), SOURCE_SHORT[src]])
    );
    return [...(scaleLine ? [scaleLine] : []), ...cards, legend];
  }

  private _renderDeviceMemory(d: IDeviceMemory): HTMLElement {
    const markers = d.markers.map(m =>
      h('div', {
        class: `jp-Llama-marker jp-Llama-marker-${m.source}${m.offScale ? ' jp-mod-offscale' : ''}`,
        style: `left:${m.pct.toFixed(2)}%`,
        title: `${SOURCE_LABEL[m.source] ?? m.source}: ${fmtShort(m.bytes)}${m.offScale ? ' (off the scale)' : ''}`,
        'data-marker': m.source
      })
    );
    const fillCls = d.actual !== null ? 'jp-Llama-fill-actual' : 'jp-Llama-fill-pending';
    return h(
      'div',
      { class: 'jp-Llama-memory', 'data-device': d.device },
      h('span', { class: 'jp-Llama-device-id' }, d.device),
      h(
        'div',
        { class: 'jp-Llama-memory-main' },
        this._bar(
          d.fillPct,
          fillCls,
          `bar: actual memory, on the scale every bar shares (0 to ${roundBytesText(d.scale)}); markers: predictions`,
          markers
        ),
        h('div', { class: 'jp-Llama-small' }, d.text)
      )
    );
  }

  private _renderModels(rows: IModelRow[]): Node[] {
    if (!rows.length) {
      return [
        h(
          'div',
          { class: 'jp-Llama-muted jp-Llama-empty' },
          ...withCode('No registered models. Pull one below, or make one with `jupyter-llama create`.')
        )
      ];
    }
    return rows.map(m => {
      const busy = this.state.busy.get(m.name);
      const action = m.loaded ? 'unload' : 'load';
      const label = busy === 'loading' ? 'Loading…' : busy === 'unloading' ? 'Unloading…' : m.loaded ? 'Unload' : 'Load';
      const facts = [m.sizeText, m.quantization, m.parameters ? `${m.parameters} params` : '', m.family].filter(Boolean);
      return h(
        'div',
        { class: 'jp-Llama-model', 'data-model': m.name, 'data-loaded': m.loaded ? 'true' : 'false' },
        h(
          'div',
          { class: 'jp-Llama-model-text' },
          h(
            'div',
            { class: 'jp-Llama-row-head' },
            h('span', { class: 'jp-Llama-model-name', title: m.name }, m.name),
            m.loaded
              ? h('span', { class: `jp-Llama-tag jp-Llama-state-${m.state ?? 'ready'}` }, m.state && m.state !== 'ready' ? m.state : 'loaded')
              : null
          ),
          h('div', { class: 'jp-Llama-small jp-Llama-muted' }, facts.join(' · ')),
          m.preset
            ? h(
                'div',
                { class: 'jp-Llama-small jp-Llama-muted jp-Llama-preset', title: m.preset.title },
                ...m.preset.parts.flatMap((part, i) => [
                  i ? ' · ' : null,
                  h('span', { class: part.startsWith('system:') ? null : 'jp-Llama-nowrap' }, part)
                ])
              )
            : null
        ),
        h(
          'button',
          {
            class: `jp-Llama-button${m.loaded ? '' : ' jp-mod-accent'}`,
            'data-action': action,
            disabled: !!busy || m.state === 'unloading' || m.state === 'loading' || (m.loaded && !mayUnload(m.people)),
            title: m.loaded ? unloadTitle(m.name, m.people, `Unload ${m.name}`) : `Load ${m.name} with the default options`,
            onclick: () => void (m.loaded ? this.state.unload(m.name) : this.state.load(m.name))
          },
          label
        )
      );
    });
  }

  private _renderEvents(rows: ReturnType<typeof eventRows>): Node[] {
    if (!rows.length) {
      return [h('div', { class: 'jp-Llama-muted jp-Llama-empty' }, 'No scheduler decisions yet.')];
    }
    return [
      h(
        'ul',
        { class: 'jp-Llama-events' },
        ...rows.map(e =>
          h(
            'li',
            { 'data-seq': e.seq },
            h(
              'div',
              { class: 'jp-Llama-event-head' },
              h('span', { class: `jp-Llama-kind jp-Llama-kind-${e.kind}` }, e.kind),
              e.model ? h('span', { class: 'jp-Llama-muted' }, e.model) : null,
              h('span', { class: 'jp-Llama-muted jp-Llama-time jp-Llama-right' }, e.time)
            ),
            h('div', { class: 'jp-Llama-message' }, e.message)
          )
        )
      )
    ];
  }

  private _renderPull(): void {
    const p = this.state.pull;
    this._pullButton.disabled = !!p?.running;
    this._pullProgress.hidden = p === null;
    if (p === null) {
      return;
    }
    this._pullProgress.classList.toggle('jp-mod-error', !!p.error);
    this._pullProgress.classList.toggle('jp-mod-indeterminate', p.running && p.fraction === null);
    this._pullBar.style.width = `${((p.fraction ?? (p.done ? 1 : 0)) * 100).toFixed(1)}%`;
    this._pullClear.hidden = p.running;
    this._pullText.textContent = `${p.source}: ${p.text}`;
  }

  private _startPull(): void {
    const source = this._pullSource.value.trim();
    if (!source) {
      this._pullSource.focus();
      return;
    }
    void this.state.pullModel(source, this._pullName.value).then(() => {
      if (!this.state.pull?.error) {
        this._pullSource.value = '';
        this._pullName.value = '';
      }
    });
  }

  // ------------------------------------------------------------------ countdown

  private _startTicker(): void {
    if (this._ticker === null) {
      this._ticker = window.setInterval(() => this._tick(), 1000);
    }
  }

  private _stopTicker(): void {
    if (this._ticker !== null) {
      window.clearInterval(this._ticker);
      this._ticker = null;
    }
  }

  private _tick(): void {
    const now = Date.now() / 1000;
    this._loaded.querySelectorAll<HTMLElement>('[data-expires]').forEach(el => {
      el.textContent = countdownText(Number(el.dataset.expires), now);
    });
  }

  private _status: HTMLElement;
  private _devices: HTMLElement;
  private _loaded: HTMLElement;
  private _loadedTitle: HTMLElement;
  private _models: HTMLElement;
  private _events: HTMLElement;
  private _pullSource: HTMLInputElement;
  private _pullName: HTMLInputElement;
  private _pullButton: HTMLButtonElement;
  private _pullBar: HTMLElement;
  private _pullText: HTMLElement;
  private _pullProgress: HTMLElement;
  private _pullClear: HTMLButtonElement;
  private _sigs = new WeakMap<HTMLElement, string>();
  private _ticker: number | null = null;
}
