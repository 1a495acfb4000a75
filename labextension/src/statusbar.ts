/** The status-bar item: loaded models and memory in use against the budget; a click opens the panel. */
import { Widget } from '@lumino/widgets';

import { llamaIcon } from './icon';
import { statusSummary } from './model';
import { LlamaState } from './state';

export class LlamaStatusItem extends Widget {
  constructor(
    readonly state: LlamaState,
    private readonly _open: () => void
  ) {
    super();
    this.addClass('jp-Llama-statusItem');
    this.node.setAttribute('role', 'button');
    this.node.setAttribute('tabindex', '0');
    const icon = document.createElement('span');
    icon.className = 'jp-Llama-statusIcon';
    llamaIcon.element({ container: icon, height: '14px', width: '14px' });
    this._text = document.createElement('span');
    this.node.append(icon, this._text);
    this.node.addEventListener('click', () => this._open());
    this.node.addEventListener('keydown', ev => {
      if (ev.key === 'Enter' || ev.key === ' ') {
        this._open();
      }
    });
    state.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    this.state.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const s = this.state;
    if (s.error && s.updatedAt === null) {
      this._text.textContent = 'Llama: unavailable';
      this.node.title = s.error;
      return;
    }
    const sum = statusSummary(s.ps, s.devices);
    this._text.textContent = sum.text;
    this.node.title = s.error ? `${sum.title}\n(not updating: ${s.error})` : sum.title;
  }

  private _text: HTMLElement;
}
