"""The admin's settings for the shared manager: ``c.LlamaHub.<name>`` in the service's config
file (``jupyter-llama serve --config FILE``, Python or JSON as every Jupyter config file).

Who is an admin of the service, the quotas, whether users may keep models of their own, and
which namespaces of the store are shared. docs/hub.md says what each does, with examples.
"""

from __future__ import annotations

from traitlets import Bool, Dict, List, Set, Unicode, validate
from traitlets.config import Configurable

from ..config import ConfigError
from ..models.names import parse_name
from ..scheduler.fairness import QuotaTable, Who, parse_quotas, private_namespace, private_owner, quota_for

__all__ = ["LlamaHub"]


class LlamaHub(Configurable):
    """jupyter-llama as a JupyterHub service: admins, quotas, users' own models."""

    admin_users = Set(Unicode(), help="Hub users who administer this service: they see every user's models and "
                                      "requests, may stop any model, and edit the shared library.").tag(config=True)

    admin_groups = Set(Unicode(), help="Hub groups whose members administer this service (as admin_users).").tag(
        config=True)

    hub_admins = Bool(True, help="Whether the Hub's own admins (a user model that says admin) administer this "
                                 "service too.").tag(config=True)

    quotas = Dict(help="""Limits per user, per group and by default:
        {"default": {"memory": "4GiB", "models": 1, "concurrent": 4, "per_minute": 60},
         "groups": {"staff": {"memory": {"cuda:0": "20GiB", "cpu": "8GiB"}, "models": 3}},
         "users": {"alice": {"per_minute": null}}}.
        memory: bytes on each device (one size for every device, or one per device; '*' for the
        devices not named) that the models a user's requests loaded may hold; models: how many
        such models at once; concurrent: the user's requests running or waiting at once;
        per_minute: the user's requests in the last minute. A limit left out comes from the
        user's groups (the most generous), else the default; null is no limit. Over a limit,
        a request is answered 429 (concurrent, per_minute) or 507 (memory, models), with a
        sentence that names the quota.""").tag(config=True)

    @validate("quotas")
    def _check_quotas(self, proposal):
        try:
            parse_quotas(proposal["value"])
        except ConfigError as e:
            raise ConfigError(f"LlamaHub.{e}") from None
        return proposal["value"]

    user_models = Bool(True, help="Whether users may create, pull, copy and delete models of their own, under "
                                  "their namespace ('alice/mymodel'), which only they (and admins) see. The "
                                  "shared library is read-only to users either way.").tag(config=True)

    shared_namespaces = List(Unicode(), help="Namespaces of models made on this machine that every user sees, "
                                             "besides 'library' (the bare names: 'tiny' is library/tiny). "
                                             "Any other namespace of a model made here belongs to the user of "
                                             "that namespace.").tag(config=True)

    @property
    def quota_table(self) -> QuotaTable:
        return parse_quotas(self.quotas)

    def who_quota(self, who: Who):
        """The quota that applies to ``who``."""
        return quota_for(who, self.quota_table)

    def who(self, name: str, groups=(), hub_admin: bool = False) -> Who:
        """The person behind a request, with the admin rights this service gives them."""
        groups = tuple(sorted(groups or ()))
        admin = (name in self.admin_users or bool(set(groups) & set(self.admin_groups))
                 or (self.hub_admins and bool(hub_admin)))
        return Who(name, groups, admin)

    def namespace(self, who: Who) -> str:
        """The namespace of ``who``'s own models."""
        return private_namespace(who.name, self.shared_namespaces)

    def owner(self, name: str) -> str | None:
        """The namespace that owns the model ``name`` (None: a shared model, or a text that is
        not a model name, such as a path: who may read a path is decided elsewhere)."""
        try:
            parsed = parse_name(name)
        except (ValueError, ConfigError):
            return None
        host, namespace = parsed.parts[0], parsed.parts[1]
        return private_owner(host, namespace, self.shared_namespaces)

    def may_see(self, who: Who, name: str) -> bool:
        """Whether ``who`` may see (use, show, list) the model ``name``: a shared one, or their own."""
        if who.admin:
            return True
        owner = self.owner(name)
        return owner is None or owner.lower() == self.namespace(who).lower()

    def write_refusal(self, who: Who, name: str, what: str) -> str | None:
        """None when ``who`` may ``what`` (create, delete, ...) the model ``name``, else why not."""
        if who.admin:
            return None
        mine = self.namespace(who)
        owner = self.owner(name)
        if owner is not None and owner.lower() == mine.lower():
            if self.user_models:
                return None
            return (f"{who.name} may not {what} {name}: this service keeps no models of users' own "
                    "(LlamaHub.user_models is off); ask its admin")
        if not self.user_models:
            return (f"{who.name} may not {what} {name}: the shared library is the admin's, and this service keeps "
                    "no models of users' own")
        return (f"{who.name} may not {what} {name}: the shared library is the admin's; name a model of your "
                f"own under your namespace, as {mine}/{name.split('/')[-1]}")
