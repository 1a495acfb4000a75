/**
 * The REST API under ``<base_url>llama/``, through JupyterLab's ServerConnection so
 * that the token, cookies and XSRF header are those of the running lab.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import {
  IDevices,
  IEvent,
  IMe,
  IPs,
  IPullStatus,
  IShow,
  ITags,
  NdjsonSplitter,
  errorMessage
} from './model';

/** An error answered by the API (or a network failure), with a short message. */
export class LlamaApiError extends Error {
  constructor(
    message: string,
    readonly status: number | null = null
  ) {
    super(message);
    this.name = 'LlamaApiError';
  }
}

export class LlamaApi {
  constructor(
    readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {}

  url(...parts: string[]): string {
    return URLExt.join(this.settings.baseUrl, 'llama', ...parts);
  }

  private async _fetch(path: string, init: RequestInit): Promise<Response> {
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(
        this.url(path),
        init,
        this.settings
      );
    } catch (e) {
      throw new LlamaApiError(
        `cannot reach the Jupyter server: ${(e as Error).message ?? e}`
      );
    }
    if (!response.ok) {
      const text = await response.text().catch(() => '');
      let body: unknown = text;
      try {
        body = JSON.parse(text);
      } catch {
        // not JSON: the text itself
      }
      if (response.status === 404 && path.startsWith('api/') && !text.includes('"error"')) {
        body = 'the jupyter-llama server extension is not enabled on this server';
      }
      throw new LlamaApiError(errorMessage(body, response.status), response.status);
    }
    return response;
  }

  async get<T>(path: string): Promise<T> {
    const r = await this._fetch(path, { method: 'GET' });
    return (await r.json()) as T;
  }

  async post<T>(path: string, body: unknown): Promise<T> {
    const r = await this._fetch(path, {
      method: 'POST',
      body: JSON.stringify(body),
      headers: { 'Content-Type': 'application/json' }
    });
    const text = await r.text();
    const obj = text ? (JSON.parse(text) as T & { error?: string }) : ({} as T);
    if (obj && typeof obj === 'object' && (obj as { error?: string }).error) {
      throw new LlamaApiError(errorMessage(obj));
    }
    return obj as T;
  }

  ps(): Promise<IPs> {
    return this.get<IPs>('api/ps');
  }

  tags(): Promise<ITags> {
    return this.get<ITags>('api/tags');
  }

  /** One model's metadata and preset (``POST api/show``, Ollama's answer). */
  show(model: string): Promise<IShow> {
    return this.post<IShow>('api/show', { model });
  }

  devices(): Promise<IDevices> {
    return this.get<IDevices>('api/devices');
  }

  /** Who this page's user is to the manager (``GET api/me``: on a shared one, whether they
   * administer it). */
  me(): Promise<IMe> {
    return this.get<IMe>('api/me');
  }

  async events(limit = 20): Promise<IEvent[]> {
    const body = await this.get<{ events?: IEvent[] }>(`api/events?limit=${limit}`);
    return body.events ?? [];
  }

  /** Load ``model`` (an empty prompt loads, as in Ollama). */
  load(model: string, keepAlive?: string | number): Promise<unknown> {
    const body: { [k: string]: unknown } = { model, stream: false };
    if (keepAlive !== undefined) {
      body['keep_alive'] = keepAlive;
    }
    return this.post('api/generate', body);
  }

  /** Unload ``model`` (keep_alive 0). */
  unload(model: string): Promise<unknown> {
    return this.post('api/generate', { model, keep_alive: 0, stream: false });
  }

  /**
   * Pull ``source`` (a URL or ``hf.co/owner/repo[:quant]``), calling ``progress`` for
   * each NDJSON status line; resolves with the last one, rejects on an error line.
   */
  async pull(
    source: string,
    progress: (st: IPullStatus) => void,
    destination?: string
  ): Promise<IPullStatus> {
    const body: { [k: string]: unknown } = { model: source, stream: true };
    if (destination) {
      body['destination'] = destination;
    }
    const r = await this._fetch('api/pull', {
      method: 'POST',
      body: JSON.stringify(body),
      headers: { 'Content-Type': 'application/json' }
    });
    const splitter = new NdjsonSplitter();
    let last: IPullStatus = {};
    const handle = (items: unknown[]) => {
      for (const item of items) {
        last = item as IPullStatus;
        progress(last);
        if (last.error) {
          throw new LlamaApiError(last.error);
        }
      }
    };
    if (r.body && typeof r.body.getReader === 'function') {
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      for (;;) {
        const { done, value } = await reader.read();
        if (done) {
          break;
        }
        handle(splitter.push(decoder.decode(value, { stream: true })));
      }
      handle(splitter.push(decoder.decode()));
    } else {
      handle(splitter.push(await r.text()));
    }
    handle(splitter.end());
    return last;
  }
}
