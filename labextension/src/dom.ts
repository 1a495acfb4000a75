/** A tiny DOM builder for the panel (no framework: the views are small). */
import { codeSpans } from './model';

export type Child = Node | string | null | undefined | false;

export interface IAttrs {
  [name: string]: string | number | boolean | null | undefined | ((ev: Event) => void);
}

/** ``h('div', {class: 'x', onclick: f}, child, ...)``: attributes, listeners (``on*``), children. */
export function h(tag: string, attrs: IAttrs | null, ...children: (Child | Child[])[]): HTMLElement {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs ?? {})) {
    if (v === null || v === undefined || v === false) {
      continue;
    }
    if (typeof v === 'function') {
      el.addEventListener(k.replace(/^on/, ''), v);
    } else if (k === 'style') {
      el.setAttribute('style', String(v));
    } else if (v === true) {
      el.setAttribute(k, '');
    } else {
      el.setAttribute(k, String(v));
    }
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) {
      continue;
    }
    el.appendChild(typeof c === 'string' ? document.createTextNode(c) : c);
  }
  return el;
}

/** Help text as nodes, its ``code`` spans (between backticks) in ``<code>``: a person reads
 * ``jupyter-llama create`` as a command, never the backticks themselves. */
export function withCode(text: string): Node[] {
  return codeSpans(text).map(p => (p.code ? h('code', null, p.text) : document.createTextNode(p.text)));
}
