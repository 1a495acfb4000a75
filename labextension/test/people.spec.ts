// Issue 57: on a manager shared through a JupyterHub, a loaded model's card says who loaded
// and uses it, as the viewer may see it (an admin every name, anyone else themselves and a
// count), and its Unload button is off where the manager would refuse the viewer. On a single
// user's manager ps has none of those fields, and nothing of this shows.
import { describe, expect, it } from 'vitest';

import {
  IN_USE_BY_OTHERS,
  IPs,
  IPsModel,
  ITags,
  LOADED_BY_ANOTHER,
  hasPeople,
  loadedRows,
  modelRows,
  peopleOf
} from '../src/model';

import fixture from './fixtures/loaded-cpu.json';

// The shapes of tests/hub/test_sharing.py::test_a_shared_model_and_private_ones: alice's
// request loaded tiny, bob's used it too.
const asAdmin: IPsModel = {
  name: 'tiny:latest',
  refcount: 0,
  loaded_by: 'alice',
  users: {},
  used_by: ['alice', 'bob'],
  waiting: {}
};
const asBob: IPsModel = { name: 'tiny:latest', refcount: 0, loaded_by: null, users: {}, used_by: ['bob'], waiting: {}, other_users: 1 };
const asAlice: IPsModel = { name: 'tiny:latest', refcount: 0, loaded_by: 'alice', users: {}, used_by: ['alice'], waiting: {}, other_users: 1 };

describe('who holds a model, as the viewer may see it', () => {
  it('is nothing on a single user’s manager', () => {
    const ps = fixture.ps as IPs;
    expect(hasPeople(ps.models![0])).toBe(false);
    expect(peopleOf(ps.models![0], null)).toBeNull();
    expect(peopleOf(ps.models![0], { name: 'me', shared: false })).toBeNull();
    expect(loadedRows(ps, null, 0)[0].people).toBeNull();
    expect(modelRows(fixture.tags as ITags, ps)[0].people).toBeNull();
  });

  it('names everyone to an admin, who may unload it', () => {
    expect(peopleOf(asAdmin, { name: 'admin', admin: true })).toMatchObject({
      text: 'loaded by alice · used by alice, bob',
      mayUnload: true,
      refusal: null
    });
    // before api/me answers, the entry's own shape says it: no other_users is an admin's view
    expect(peopleOf(asAdmin)!.text).toBe('loaded by alice · used by alice, bob');
    // no user's request loaded it: only its users are named
    expect(peopleOf({ ...asAdmin, loaded_by: null }, { admin: true })!.text).toBe('used by alice, bob');
  });

  it('names nobody else to a user; another user’s load is not theirs to unload', () => {
    const bob = peopleOf(asBob, { name: 'bob', admin: false })!;
    expect(bob.text).toBe('loaded by another user · used by you and 1 other');
    expect(bob.parts).toEqual(['loaded by another user', 'used by you and 1 other']);
    expect(bob.mayUnload).toBe(false);
    expect(bob.refusal).toBe(LOADED_BY_ANOTHER);
    expect(bob.refusal).toContain("another user's request loaded it; only they or an admin can unload it");
    expect(bob.text + bob.title).not.toContain('alice');
    expect(peopleOf(asBob)!.text).toBe(bob.text); // other_users: a user's view, without api/me

    const carol = peopleOf({ ...asBob, used_by: [] }, { admin: false })!;
    expect(carol.text).toBe('loaded by another user');
    expect(carol.mayUnload).toBe(false);
    expect(peopleOf({ ...asBob, used_by: [], other_users: 3 }, { admin: false })!.text).toBe(
      'loaded by another user · used by 3 other users'
    );
    expect(peopleOf({ ...asBob, other_users: 2 }, { admin: false })!.text).toBe(
      'loaded by another user · used by you and 2 others'
    );
  });

  it('says "loaded by you" to its loader, who may unload it while nobody else’s request runs', () => {
    const alone = peopleOf({ ...asAlice, other_users: 0 }, { name: 'alice', admin: false })!;
    expect(alone).toMatchObject({ text: 'loaded by you', mayUnload: true, refusal: null });
    const shared = peopleOf(asAlice, { name: 'alice', admin: false })!;
    expect(shared).toMatchObject({ text: 'loaded by you · used by you and 1 other', mayUnload: true });
    // another user's request in flight (refcount beyond her own): the manager refuses for now
    const busy = peopleOf({ ...asAlice, refcount: 2, users: { alice: 1 } }, { admin: false })!;
    expect(busy).toMatchObject({ mayUnload: false, refusal: IN_USE_BY_OTHERS });
    // her own requests only: hers to unload
    expect(peopleOf({ ...asAlice, refcount: 1, users: { alice: 1 } }, { admin: false })!.mayUnload).toBe(true);
  });

  it('no user’s request loaded it and nobody else uses it: the user may unload it', () => {
    const p = peopleOf({ ...asBob, other_users: 0 }, { admin: false })!;
    expect(p).toMatchObject({ text: 'used by you', mayUnload: true, refusal: null });
    expect(peopleOf({ ...asBob, used_by: [], other_users: 0 }, { admin: false })!.text).toBe('');
  });

  it('reaches the loaded cards and the registered models’ rows', () => {
    const ps: IPs = { models: [asBob] };
    const me = { name: 'bob', admin: false };
    expect(loadedRows(ps, null, 0, me)[0].people).toMatchObject({ mayUnload: false });
    const rows = modelRows({ models: [{ name: 'tiny' }, { name: 'other' }] }, ps, undefined, me);
    expect(rows.map(r => [r.name, r.loaded, r.people?.text ?? null])).toEqual([
      ['other', false, null],
      ['tiny', true, 'loaded by another user · used by you and 1 other']
    ]);
  });
});
