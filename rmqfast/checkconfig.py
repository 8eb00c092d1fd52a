"""``rmqfast check-config``: what a valid configuration sets up, one line per part.

Every section that can be switched on has its line, saying "off" when it is: a reader sees at a
glance what this proxy will do, including what it refuses (the admin request codes denied, the
ones a preset or ``policy.allow_codes`` let through).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rmqfast import config as config_mod
from rmqfast.codec import admincodes
from rmqfast.codec import codes as C
from rmqfast.settings.engine import sections
from rmqfast.settings.reference import changed, reference, replace_generated

#: How many codes a line lists by number before it only counts them.
_LIST_AT_MOST = 12


def _codes(values: frozenset[int] | list[int]) -> str:
    nums = sorted(values)
    if len(nums) > _LIST_AT_MOST:
        return f"{len(nums)} codes ({', '.join(map(str, nums[:_LIST_AT_MOST]))}, ...)"
    return ", ".join(map(str, nums))


def describe_policy(pol: config_mod.PolicySection) -> str:
    """Which request codes pass: the data plane always; admin codes only by preset or allow_codes."""
    parts = [f"data-plane codes pass ({len(C.BROKER_DATA_PLANE_CODES)} broker, "
             f"{len(C.NAMESRV_DATA_PLANE_CODES)} name-server)"]
    if pol.preset:
        broker = admincodes.preset_codes(pol.preset, "broker")
        ns = admincodes.preset_codes(pol.preset, "namesrv")
        parts.append(f'policy.preset = "{pol.preset}": {len(broker)} read-only broker and {len(ns)} name-server '
                     "admin codes allowed, every other admin code denied")
    else:
        parts.append('every admin code denied (policy.preset = "read-only-admin" would allow the read-only ones)')
    if pol.allow_codes:
        parts.append(f"also allowed: {_codes(pol.allow_codes)}")
    if pol.deny_codes:
        parts.append(f"denied whatever else says: {_codes(pol.deny_codes)}")
    return "; ".join(parts)


def describe_addresses(cfg: config_mod.Config) -> str:
    """Which broker addresses a client sees are replaced by this proxy's endpoints."""
    mode = cfg.policy.message_addresses
    base = "route answers point at rmqfast"
    if mode == "off":
        return base + ('; addresses inside messages left as the broker wrote them (policy.message_addresses = '
                       '"off": queryMsgById, viewMessage and send-backs go to the real brokers)')
    if mode == "records":
        return base + ("; store hosts in pulled/queried messages too, but not send answers' offset msgIds "
                       '(policy.message_addresses = "records": queryMsgById goes to the real broker)')
    return base + "; so do store hosts in messages and send answers' offset msgIds"


def describe_delay(cfg: config_mod.Config) -> str:
    d = cfg.delay
    if not d.enabled:
        return "off (delayed messages go to the broker's own schedule)"
    return (f"held by rmqfast for {', '.join(d.topics)}: up to {d.max_pending_bytes:,} bytes pending, "
            f"delays up to {d.max_delay_ms / 86_400_000:g} days")


def describe_gray(cfg: config_mod.Config) -> str:
    g = cfg.gray
    if not g.enabled:
        return "off"
    groups = ", ".join(f"{x.group} ({len(x.topics)} topic(s), {x.gray_queues} gray queue(s) per broker)"
                       for x in g.groups)
    return f"{len(g.groups)} group(s): {groups}"


def describe_grpc(cfg: config_mod.Config) -> str:
    g = cfg.grpc
    if not g.enabled:
        return "off"
    return (f"RocketMQ 5 gRPC clients on {g.listen} ({'TLS' if g.tls else 'plaintext'}, {g.server} server, "
            f"pop {'with' if g.notify else 'without'} notify)")


def summary(path: str | None, cfg: config_mod.Config) -> str:
    """What a valid configuration sets up, in a few lines (``rmqfast check-config``)."""
    from rmqfast.proxy.tls import describe_tls

    p, b = cfg.proxy, cfg.brokers
    ups = ", ".join(str(u) for u in cfg.namesrv.upstreams)
    workers = f"{p.workers}" if p.workers else f"one per usable CPU ({cfg.worker_count} here)"
    if b.port_range is not None:
        brokers = (f"ports {b.port_range[0]}-{b.port_range[1]} on {cfg.broker_listen_host} for the brokers "
                   f"the routes name, advertised as {cfg.advertise_host}")
    else:
        brokers = "no automatic endpoints"
    if b.static:
        brokers += f"; {len(b.static)} static (" + ", ".join(f"{s.listen} -> {s.upstream}" for s in b.static) + ")"
    if cfg.admin.listen is None:
        admin = "off"
    else:
        changes = "need the admin.token" if cfg.admin.token else "from loopback only (no admin.token)"
        admin = f"http://{cfg.admin.listen}/ (/metrics /healthz /readyz /limits; limit changes {changes})"
        hosts = cfg.admin.allowed_hosts
        if hosts:
            admin += f"; Host/Origin also allowed: {', '.join(hosts)}"
    rules = cfg.limits.all_rules()
    limits = f"{len(rules)} rule(s)" if rules else "none"
    records = (f"on, every {cfg.records.rotate_seconds:g} s into {cfg.records.dir} ({cfg.records.format})"
               if cfg.records.enabled else "off")
    clouds = "off"
    if cfg.replication_enabled:
        clouds = (f"{cfg.replicate.durability}, to " + ", ".join(r.name for r in cfg.clouds.remotes)
                  + f"; {len(cfg.replicate.topics)} topic rule(s), default {cfg.replicate.default}")
    acl = "off (signed requests pass through unchanged)"
    if cfg.acl.enabled:
        acl = (f"{len(cfg.acl.topics)} AccessKey(s) listed; unsigned requests: {cfg.acl.unsigned}, "
               f"other AccessKeys: {cfg.acl.other_keys}")
        if cfg.grpc.enabled:  # the gRPC front verifies signatures itself
            acl += (f"; gRPC calls verified with {len(cfg.acl.secret_keys)} secret key(s)" if cfg.acl.secret_keys
                    else "; gRPC: no acl.secret_keys, so only unsigned calls can pass (acl.unsigned)")
    fo = cfg.failover
    failover = "off (clients of a dead broker get SYSTEM_ERROR)"
    if fo.enabled:
        failover = (f"probes every {fo.probe_interval:g} s (timeout {fo.probe_timeout:g} s); sends to a dead broker "
                    f"moved; routes healed: {'yes' if fo.heal_routes else 'no'}; GO_AWAY on drain: "
                    f"{'yes' if fo.go_away else 'no'}; ordered topics: {', '.join(fo.ordered_topics) or 'none listed'}")
    rows = [
        ("name servers", f"clients connect to {cfg.namesrv.listen}, relayed to {ups}"),
        ("brokers", brokers),
        ("workers", workers),
        ("admin endpoint", admin),
        ("policy", describe_policy(cfg.policy)),
        ("addresses", describe_addresses(cfg)),
        ("topic allowlist", acl),
        ("send limits", limits),
        ("delay", describe_delay(cfg)),
        ("gray releases", describe_gray(cfg)),
        ("gRPC front", describe_grpc(cfg)),
        ("traffic records", records),
        ("cross-cloud", clouds),
        ("broker failover", failover),
        ("TLS", describe_tls(cfg.tls)),
        ("logs", f"{cfg.log.format}, level {cfg.log.level}; state in {p.state_dir}"),
    ]
    own = [line for name in sorted(sections()) for line in changed(name, getattr(cfg, name))]
    # generated from the declarations: every declared value the file changes, written as TOML
    rows.append(("changed keys", "; ".join(own) or "none (every declared key at its default)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{path or '(flags only)'}: ok"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def write_reference(page: Path) -> bool:
    """Rewrite the generated part of ``page`` (docs/configuration.md); True when it changed."""
    old = page.read_text(encoding="utf-8")
    new = replace_generated(old, reference(sections()))
    if new != old:
        page.write_text(new, encoding="utf-8")
    return new != old


if __name__ == "__main__":  # python -m rmqfast.checkconfig --write-reference [PAGE]
    if sys.argv[1:2] != ["--write-reference"]:
        sys.exit("usage: python -m rmqfast.checkconfig --write-reference [docs/configuration.md]")
    target = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/configuration.md")
    print(f"{target}: {'rewritten' if write_reference(target) else 'up to date'}")
