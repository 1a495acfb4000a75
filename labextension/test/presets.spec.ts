import { describe, expect, it } from 'vitest';

import { IShow, ITags, modelRows, parametersFromText, presetSummary, shorten } from '../src/model';
import { PresetCache, presetKey } from '../src/presets';

// Answers recorded from a real server: tiny (no preset), mario (every kind of preset
// field) and mario2 (created with system "You are Mario" and num_predict 3), both from tiny.
import fixture from './fixtures/presets.json';

const tags = fixture.tags as ITags;
const shows = fixture.show as unknown as { [name: string]: IShow };

describe('presetSummary', () => {
  it('is null for a model without a preset, though show carries the GGUF template', () => {
    const tiny = shows['tiny:latest'];
    expect(tiny.template).toContain('im_start'); // the GGUF's own: not a custom template
    expect(presetSummary(tiny)).toBeNull();
    expect(presetSummary(null)).toBeNull();
    expect(presetSummary({})).toBeNull();
  });
  it('shows the system message and each parameter; the Modelfile is the tooltip', () => {
    const s = presetSummary(shows['mario2:latest'])!;
    expect(s.text).toBe('system: “You are Mario” · num_predict 3');
    expect(s.title).toBe(shows['mario2:latest'].modelfile!.trim());
    expect(s.title).toContain('SYSTEM You are Mario');
    expect(s.title).toContain('PARAMETER num_predict 3');
  });
  it('shortens the system message, groups a repeated parameter, counts messages, notes a template', () => {
    const s = presetSummary(shows['mario:latest'])!;
    expect(s.text).toBe(
      'system: “You are Mario from Super Mario Bros.…” · temperature 0 · num_predict 3 · ' +
        'stop "<|im_end|>" "User:" · 2 messages · custom template'
    );
    expect(s.title).toContain('MESSAGE assistant It is-a me, Mario!');
  });
  it('reads an Ollama-shaped answer (no preset field): its template is not counted', () => {
    const s = presetSummary({
      system: 'Be\n  brief.',
      parameters: 'temperature                    0.7\nnum_ctx                        4096',
      template: '{{ .Prompt }}',
      messages: [{ role: 'user', content: 'hi' }],
      modelfile: 'FROM x\nSYSTEM Be brief.\n'
    })!;
    expect(s).toEqual({
      text: 'system: “Be brief.” · temperature 0.7 · num_ctx 4096 · 1 message',
      parts: ['system: “Be brief.”', 'temperature 0.7', 'num_ctx 4096', '1 message'],
      title: 'FROM x\nSYSTEM Be brief.'
    });
  });
  it('takes the stored parameters without the text form, and a lone license', () => {
    expect(presetSummary({ preset: { parameters: { stop: ['a', 'b'], top_k: 5 } } })!.text).toBe('stop "a" "b" · top_k 5');
    const lic = presetSummary({ preset: { license: ['MIT'] } })!;
    expect(lic).toEqual({ text: 'license', parts: ['license'], title: 'license' });
  });
  it('cuts long values and text', () => {
    expect(shorten('a  b\n c', 40)).toBe('a b c');
    expect(shorten('x'.repeat(50), 10)).toBe('xxxxxxxxx…');
    expect(shorten('one two three four', 10)).toBe('one two…'); // at a word's end
    expect(shorten('one two three', 8)).toBe('one two…');
    expect(Array.from(shorten('😀'.repeat(50), 5))).toHaveLength(5);
    expect(parametersFromText('stop     "x y"\n\nmirostat\n')).toEqual([
      ['stop', '"x y"'],
      ['mirostat', '']
    ]);
    const long = presetSummary({ parameters: `stop ${'"' + 'z'.repeat(60) + '"'}` })!;
    expect(long.text.length).toBeLessThan(40);
  });
});

describe('modelRows with presets', () => {
  it('puts the summary on the row of the model that has one', () => {
    const cache = new Map(
      tags.models!.map(m => [presetKey(m.name!, m.digest), presetSummary(shows[m.name!])])
    );
    const rows = modelRows(tags, null, (name, digest) => cache.get(presetKey(name, digest)));
    expect(rows.map(r => [r.name, r.preset?.text ?? null])).toEqual([
      ['mario2:latest', 'system: “You are Mario” · num_predict 3'],
      ['mario:latest', expect.stringContaining('custom template')],
      ['tiny:latest', null]
    ]);
    expect(modelRows(tags).every(r => r.preset === null)).toBe(true);
  });
});

/** A fake ``api/show``: the recorded answers, counting calls; ``fail`` names fail. */
function fakeShow(fail = new Set<string>()) {
  const calls: string[] = [];
  let answers = { ...shows };
  return {
    calls,
    set(name: string, show: IShow) {
      answers = { ...answers, [name]: show };
    },
    show: async (name: string): Promise<IShow> => {
      calls.push(name);
      await new Promise(r => setTimeout(r, 1));
      if (fail.has(name)) {
        throw new Error('model not found (HTTP 404)');
      }
      return answers[name];
    }
  };
}

describe('PresetCache', () => {
  it('asks show once per model and digest, not on every poll', async () => {
    const api = fakeShow();
    let changed = 0;
    const cache = new PresetCache({ show: api.show, changed: () => changed++ });
    cache.update(tags);
    cache.update(tags); // a second poll while the calls are under way: no new call
    expect(cache.pending).toBe(3);
    await cache.settled();
    expect(api.calls.sort()).toEqual(['mario2:latest', 'mario:latest', 'tiny:latest']);
    expect(changed).toBe(2); // tiny has no preset: nothing changed for it
    expect(cache.get('mario2:latest', tags.models![0].digest)!.text).toBe('system: “You are Mario” · num_predict 3');
    expect(cache.get('tiny:latest', tags.models![2].digest)).toBeNull();
    for (let i = 0; i < 5; i++) {
      cache.update(tags);
    }
    await cache.settled();
    expect(api.calls).toHaveLength(3);
  });

  it('asks again when a digest changes (a new preset), and forgets removed models', async () => {
    const api = fakeShow();
    const cache = new PresetCache({ show: api.show });
    cache.update(tags);
    await cache.settled();
    api.calls.length = 0;
    const newer = { ...shows['mario2:latest'], parameters: 'num_predict                    5', preset: { system: 'You are Mario', parameters: { num_predict: 5 } } };
    api.set('mario2:latest', newer);
    const changedTags: ITags = {
      models: [{ ...tags.models![0], digest: 'f'.repeat(64) }, tags.models![2]] // mario removed
    };
    cache.update(changedTags);
    await cache.settled();
    expect(api.calls).toEqual(['mario2:latest']);
    expect(cache.get('mario2:latest', 'f'.repeat(64))!.text).toBe('system: “You are Mario” · num_predict 5');
    expect(cache.get('mario:latest', tags.models![1].digest)).toBeNull(); // forgotten
    // it comes back: asked again
    cache.update(tags);
    await cache.settled();
    expect(api.calls.sort()).toEqual(['mario2:latest', 'mario2:latest', 'mario:latest']);
  });

  it('shares one call between names of one manifest (a copy)', async () => {
    const api = fakeShow();
    const cache = new PresetCache({ show: api.show });
    const m = tags.models![0];
    cache.update({ models: [m, { ...m, name: 'luigi:latest', model: 'luigi:latest' }] });
    await cache.settled();
    expect(api.calls).toEqual(['mario2:latest']);
    expect(cache.get('luigi:latest', m.digest)!.text).toContain('num_predict 3');
  });

  it('survives a failed show: no line, and no new call before retryMs', async () => {
    const api = fakeShow(new Set(['mario:latest']));
    let now = 1000;
    let changed = 0;
    const cache = new PresetCache({ show: api.show, retryMs: 30_000, now: () => now, changed: () => changed++ });
    cache.update(tags);
    await cache.settled();
    expect(cache.get('mario:latest', tags.models![1].digest)).toBeNull();
    expect(cache.get('mario2:latest', tags.models![0].digest)).not.toBeNull();
    now += 29_000;
    cache.update(tags);
    await cache.settled();
    expect(api.calls.filter(c => c === 'mario:latest')).toHaveLength(1);
    now += 2_000;
    cache.update(tags);
    await cache.settled();
    expect(api.calls.filter(c => c === 'mario:latest')).toHaveLength(2);
    expect(api.calls.filter(c => c === 'mario2:latest')).toHaveLength(1);
    expect(changed).toBe(1);
  });

  it('drops an answer for a model that went away meanwhile, and stops when disposed', async () => {
    const api = fakeShow();
    let changed = 0;
    const cache = new PresetCache({ show: api.show, changed: () => changed++ });
    cache.update(tags);
    cache.update({ models: [] });
    await cache.settled();
    expect(changed).toBe(0);
    expect(cache.get('mario2:latest', tags.models![0].digest)).toBeNull();
    cache.dispose();
    cache.update(tags);
    expect(cache.pending).toBe(0);
  });

  it('keys by digest, else by name', () => {
    expect(presetKey('a:latest', 'abc')).toBe('digest:abc');
    expect(presetKey('A:latest', '')).toBe('name:a:latest');
  });
});
