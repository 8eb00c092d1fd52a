"""Send limits: GCRA bucket math with an injected clock, rule matching, the scanner's decisions,
and the two twins (compiled, pure Python) against each other."""

from __future__ import annotations

import random
import re

import pytest

from rmqfast import codec
from rmqfast.codec._header_py import props_tag
from rmqfast.errors import ConfigError
from rmqfast.limits import LimiterC, LimiterPy, new_shared_memory
from rmqfast.limits.rules import LimitRule, LimitsSection, parse_limits, remove, upsert
from tests.test_scan import binary_frame, json_frame

S = 1_000_000_000  # one second in ns


def shm_for(limiter_cls):
    """Anonymous bucket memory whose header names the twin of ``limiter_cls``."""
    return new_shared_memory("compiled" if codec.is_compiled(limiter_cls) else "python")

T0 = 1_000 * S


@pytest.fixture
def make(twin):
    """Build a limiter of each twin (the ``twin`` fixture of tests/conftest.py) with ``rules``."""
    def build(*rules):
        lim = twin.Limiter(shm_for(twin.Limiter))
        lim.configure(list(rules))
        return lim

    return build


def rule(topic, tag=None, rate=0.0, burst=1.0, brate=0.0, bburst=0.0, mode=0, slot=1):
    return (topic, tag, rate, burst, brate, bburst, mode, slot)


def test_burst_then_refill_at_the_rate(make):
    lim = make(rule(b"T", rate=10, burst=5))
    assert [lim.admit(b"T", now_ns=T0) for _ in range(6)] == [-1] * 5 + [0]
    assert lim.admit(b"T", now_ns=T0 + S // 10 - 1) == 0  # not yet: one token per 100 ms
    assert lim.admit(b"T", now_ns=T0 + S // 10) == -1
    assert lim.counters() == [(0, 6, 2)]


def test_fractional_rates(make):
    lim = make(rule(b"T", rate=0.5, burst=1))  # one message every 2 s
    assert lim.admit(b"T", now_ns=T0) == -1
    assert lim.admit(b"T", now_ns=T0 + S) == 0
    assert lim.admit(b"T", now_ns=T0 + 2 * S) == -1
    lim = make(rule(b"T", rate=2.5, burst=1))
    admitted = sum(lim.admit(b"T", now_ns=T0 + i * S // 100) == -1 for i in range(1000))  # 10 s at 100/s offered
    assert admitted == 25


def test_clock_going_backwards_never_admits_more(make):
    lim = make(rule(b"T", rate=10, burst=2))
    assert lim.admit(b"T", now_ns=T0) == -1 and lim.admit(b"T", now_ns=T0) == -1
    # an earlier timestamp (another worker's clock read a moment before) finds the bucket empty
    assert lim.admit(b"T", now_ns=T0 - 5 * S) == 0
    assert lim.admit(b"T", now_ns=T0 + S // 10) == -1


def test_huge_idle_gap_refills_only_to_the_burst(make):
    lim = make(rule(b"T", rate=100, burst=3))
    assert lim.admit(b"T", now_ns=T0) == -1
    later = T0 + 10**6 * S  # ~11.6 days idle
    assert [lim.admit(b"T", now_ns=later) for _ in range(4)] == [-1, -1, -1, 0]


def test_steady_state_rate_is_exact(make):
    lim = make(rule(b"T", rate=1000, burst=10))
    admitted = sum(lim.admit(b"T", now_ns=T0 + i * 100_000) == -1 for i in range(100_000))  # 10 k/s for 10 s
    assert admitted == 10_000 + 10 - 1  # rate * duration, plus the burst minus the first token


def test_batches_count_every_message_and_big_batches_pass_only_on_a_full_bucket(make):
    lim = make(rule(b"T", rate=10, burst=5))
    assert lim.admit(b"T", msgs=4, now_ns=T0) == -1
    assert lim.admit(b"T", msgs=2, now_ns=T0) == 0  # 1 token left
    lim = make(rule(b"T", rate=10, burst=5))
    assert lim.admit(b"T", msgs=30, now_ns=T0) == -1  # full bucket: admitted, charged 3 s
    assert lim.admit(b"T", msgs=1, now_ns=T0 + 2 * S) == 0
    # the bucket has room for one message again 0.4 s before the 3 s are paid (burst 5 = 0.5 s)
    assert lim.admit(b"T", msgs=1, now_ns=T0 + 3 * S - 4 * S // 10 - 1) == 0
    assert lim.admit(b"T", msgs=1, now_ns=T0 + 3 * S - 4 * S // 10) == -1


def test_bytes_limit_and_refund_when_a_later_bucket_refuses(make):
    lim = make(rule(b"T", rate=100, burst=100, brate=1000, bburst=2000))
    assert lim.admit(b"T", nbytes=1500, now_ns=T0) == -1
    assert lim.admit(b"T", nbytes=1500, now_ns=T0) == 0  # bytes bucket: 500 left
    # the rejected send's message token was refunded: 99 more single messages fit the burst
    assert sum(lim.admit(b"T", nbytes=1, now_ns=T0) == -1 for _ in range(200)) == 99


def test_rule_matching_tag_topic_prefix_wildcard_global(make):
    lim = make(
        rule(b"orders", rate=1, burst=1, slot=1),
        rule(b"orders", b"vip", mode=2, slot=2),  # open: vip orders are never limited by the tag rule
        rule(b"ord*", rate=1, burst=2, slot=3),
        rule(b"*", rate=1, burst=3, slot=4),
        rule(b"", rate=1000, burst=4, slot=0),  # global
    )
    assert [lim.admit(b"orders", now_ns=T0) for _ in range(2)] == [-1, 0]  # exact rule beats the prefix
    assert lim.admit(b"orders", b"vip", now_ns=T0) == 0  # the topic rule still applies to vip messages
    assert [lim.admit(b"ordinal", now_ns=T0) for _ in range(3)] == [-1, -1, 2]  # prefix rule (index 2)
    assert lim.admit(b"other", now_ns=T0) == -1  # '*' (third token of the global bucket of 4)
    assert lim.admit(b"other2", now_ns=T0) == 4  # global burst of 4 spent


def test_reject_mode_is_a_circuit_breaker(make):
    lim = make(rule(b"T", b"A", mode=1, slot=1))
    assert lim.admit(b"T", b"A", now_ns=T0) == 0
    assert lim.admit(b"T", b"B", now_ns=T0) == -1 and lim.admit(b"T", now_ns=T0) == -1


@pytest.mark.parametrize("props,esc,tag", [
    (b"TAGS\x01TagA\x02KEYS\x01k\x02", False, b"TagA"),
    (b"KEYS\x01k\x02TAGS\x01TagA", False, b"TagA"),
    (b"KEYS\\u0001k\\u0002TAGS\\u0001TagB\\u0002WAIT\\u0001true\\u0002", True, b"TagB"),
    (b"XTAGS\x01no\x02", False, None),
    (b"KEYS\x01TAGS\x01not-a-key\x02", False, None),
    (b"", False, None),
    # the broker's reading: the last TAGS wins, empty values are no property, escapes are decoded
    (b"TAGS\x01benign\x02TAGS\x01limited\x02", False, b"limited"),
    (b"TAGS\x01limited\x02TAGS\x01\x02", False, b"limited"),
    (b"T\\u0041GS\\u0001Tag\\u0041", True, b"TagA"),
    (b"KEYS\\u0001x\\u0002TAGS\\u0001limited", True, b"limited"),
    # a tag hidden inside another property's value is no tag (old compiled find_tag read it)
    (b"KEYS\\u0001a\\u0032TAGS\\u0001hidden", True, None),
    (b"KEYS\x01a\x01TAGS\x01v", False, None),
])
def test_find_tag(props, esc, tag):
    assert props_tag(props, esc) == tag


def send_json(topic: str, tag: str | None, opaque: int, body: bytes = b"x" * 50, code: int = 310) -> bytes:
    props = "KEYS\u0001k\u0002" + (f"TAGS\u0001{tag}\u0002" if tag else "")
    key = "b" if code in (310, 320) else "topic"
    props_key = "i" if code in (310, 320) else "properties"
    ext = {"a": "G", key: topic, props_key: props}
    return json_frame({"code": code, "flag": 0, "opaque": opaque, "extFields": ext}, body)


def batch_body(n: int) -> bytes:
    import struct

    rec = struct.pack(">iiiii", 20 + 4 + 2, 0, 0, 0, 4) + b"body" + struct.pack(">h", 0)
    return rec * n


@pytest.fixture
def impl(twin):
    """(scanner class, stats class, limiter class) of each twin."""
    return twin.FrameScanner, twin.ScanStats, twin.Limiter


def test_scanner_stops_sends_over_the_limit_and_forwards_the_rest(impl):
    Scanner, Stats, Limiter = impl
    lim = Limiter(shm_for(Limiter))
    lim.configure([rule(b"T", rate=1, burst=2, slot=1), rule(b"T", b"slow", rate=1, burst=1, slot=2)])
    sc = Scanner(Stats(), limiter=lim)
    frames = [send_json("T", None, 1), send_json("U", None, 2), send_json("T", "slow", 3),
              send_json("T", "slow", 4), send_json("T", None, 5, code=10),
              binary_frame(310, 0, 6, {"b": "T", "i": "TAGS\x01other\x02"}),
              json_frame({"code": 320, "flag": 0, "opaque": 7, "extFields": {"b": "T", "m": "true"}}, batch_body(3))]
    data = b"".join(frames)
    events, pos = [], 0
    while True:
        ev, a, b = sc.scan(data, pos, len(data), now_ns=T0)
        if ev != codec.EV_POLICY:
            assert ev == codec.EV_FORWARD and a == len(data)
            break
        events.append((sc.opaque, sc.limited))
        pos = b
    # 1 admitted (T: 1 of 2); 2 other topic; 3 admitted by both (T: 2 of 2, slow: 1 of 1);
    # 4 over the tag rule; 5 (V1 header) over T; 6 over T; 7 a batch of 3 over T
    assert events == [(4, 1), (5, 0), (6, 0), (7, 0)]
    assert lim.counters() == [(0, 2, 5), (1, 1, 1)]


def test_limited_sends_are_decided_whole(impl):
    """A limited send split across reads is decided once, when it is complete."""
    Scanner, Stats, Limiter = impl
    lim = Limiter(shm_for(Limiter))
    lim.configure([rule(b"T", rate=1, burst=1, slot=1)])
    sc = Scanner(Stats(), limiter=lim)
    f = send_json("T", None, 1, body=b"y" * 5000) + send_json("T", None, 2)
    ev, a, b = sc.scan(f, 0, 100, now_ns=T0)
    assert (ev, a) == (codec.EV_FORWARD, 0) and b > 100  # needs the whole frame
    ev, a, b = sc.scan(f, 0, len(f), now_ns=T0)
    assert ev == codec.EV_POLICY and sc.opaque == 2 and sc.limited == 0 and a == len(f) - len(send_json("T", None, 2))
    assert lim.counters() == [(0, 1, 1)]


def test_twins_agree_on_random_traffic():
    if LimiterC is None:
        pytest.skip("compiled extension not built")
    rules = [rule(b"T", rate=10, burst=5, slot=1), rule(b"T", b"TagA", rate=2, burst=1, slot=2),
             rule(b"P*", rate=1, burst=1, mode=1, slot=3), rule(b"", rate=50, burst=20, brate=1e5, bburst=2e4, slot=0)]
    mp, mc = shm_for(LimiterPy), shm_for(LimiterC)
    p, c = LimiterPy(mp), LimiterC(mc)
    p.configure(rules)
    c.configure(rules)
    rng = random.Random(1)
    now = T0
    for _ in range(20000):
        now += rng.randrange(0, 50_000_000) - 1_000_000  # sometimes backwards
        args = (rng.choice([b"T", b"P1", b"Q"]), rng.choice([None, b"TagA", b"B"]), rng.choice([1, 1, 4, 30]),
                rng.randrange(100, 5000), now)
        assert p.admit(*args) == c.admit(*args)
    assert p.counters() == c.counters() and mp[64:] == mc[64:]  # the buckets (the headers name the twins)


def test_the_slowest_rate_and_longest_burst_allowed_still_limit(make):
    """At the bounds parse_rule allows (0.001 msg/s; 1 B/s; a burst of 10^6 s at the rate) both
    twins admit the burst and refuse the next message, as at any rate."""
    slow = parse_limits({"rule": [{"topic": "T", "rate": 0.001}]}).limiter_rules()
    lim = make(*slow)
    assert [lim.admit(b"T", now_ns=T0) for _ in range(2)] == [-1, 0]
    assert lim.admit(b"T", now_ns=T0 + 999 * S) == 0 and lim.admit(b"T", now_ns=T0 + 1000 * S) == -1
    long = parse_limits({"rule": [{"topic": "T", "rate": 1, "burst": 1e6}]}).limiter_rules()
    lim = make(*long)
    assert sum(lim.admit(b"T", msgs=1000, now_ns=T0) == -1 for _ in range(1001)) == 1000
    assert lim.admit(b"T", now_ns=T0) == 0
    tiny = parse_limits({"rule": [{"topic": "T", "bytes_rate": 1, "bytes_burst": 1e6}]}).limiter_rules()
    lim = make(*tiny)
    assert lim.admit(b"T", nbytes=1_000_000, now_ns=T0) == -1
    assert lim.admit(b"T", nbytes=1, now_ns=T0) == 0 and lim.admit(b"T", nbytes=1, now_ns=T0 + S) == -1


def test_a_batch_too_costly_to_count_is_refused_and_charges_nothing(make):
    """Millions of tiny records in one batch at the slowest rate would cost more nanoseconds
    than an int64 holds: refused (at 2**62 ns) in both twins, the bucket left as it was."""
    lim = make(*parse_limits({"rule": [{"topic": "T", "rate": 0.001}]}).limiter_rules())
    assert lim.admit(b"T", msgs=10_000_000, now_ns=10**15) == 0
    # the bucket is still full: just under 2**62 ns is admitted (a big batch passes on a full bucket)
    assert lim.admit(b"T", msgs=4_611_686, now_ns=10**15) == -1
    assert lim.admit(b"T", now_ns=10**15 + 10**18) == 0  # and paid for: no wrap-around admits the next
    # a cost that fits an int64 but whose end time would not (it wrapped negative: the next send
    # and every one after it were admitted)
    lim = make(*parse_limits({"rule": [{"topic": "T", "rate": 0.001}]}).limiter_rules())
    assert lim.admit(b"T", msgs=9_223_000, now_ns=10**15) == 0
    assert lim.admit(b"T", now_ns=10**15) == -1 and lim.admit(b"T", now_ns=10**15) == 0


def test_config_parsing_and_errors():
    sec = parse_limits({"global_rate": 1000, "rule": [{"topic": "orders", "rate": 5, "tag": "vip"},
                                                     {"topic": "logs-*", "mode": "reject"}]})
    assert [r.key for r in sec.all_rules()] == [("orders", "vip"), ("logs-*", None), ("", None)]
    assert sec.limiter_rules()[0][-1] == 1 and sec.limiter_rules()[-1][-1] == 0  # global in slot 0
    assert LimitsSection.from_dict(sec.to_dict()) == sec
    bad = [
        ({"rule": [{"topic": "T"}]}, "mode 'limit' needs rate"),
        ({"rule": [{"topic": "T", "rate": -1}]}, "limits.rule[0].rate: -1 is not allowed"),
        ({"rule": [{"topic": "a b", "rate": 1}]}, "limits.rule[0].topic"),
        ({"rule": [{"topic": "T", "rate": 1, "mode": "shape!"}]}, "limits.rule[0].mode"),
        ({"rule": [{"topic": "T", "rate": 1}, {"topic": "T", "rate": 2}]}, "already limited by limits.rule[0]"),
        ({"rule": [{"topic": "T", "rate": 1, "tag": "a||b"}]}, "limits.rule[0].tag"),
        ({"rate": 1}, "unknown key(s) rate"),
        # what the limiter's int64 nanoseconds could not hold (it would admit everything)
        ({"rule": [{"topic": "T", "rate": 1e-10}]}, "limits.rule[0].rate: 1e-10 is not allowed; expected 0 (no limit) "
                                                     "or at least 0.001"),
        ({"rule": [{"topic": "T", "rate": 1, "burst": 1e10}]}, "limits.rule[0].burst: 1e+10 is not allowed with"),
        ({"rule": [{"topic": "T", "bytes_rate": 0.5}]}, "limits.rule[0].bytes_rate: 0.5 is not allowed"),
        ({"rule": [{"topic": "T", "bytes_rate": 1, "bytes_burst": 1e12}]}, "limits.rule[0].bytes_burst: 1e+12"),
        ({"global_rate": 1e-9}, "limits.global_rate: 1e-09 is not allowed"),
        ({"global_bytes_rate": 5, "global_bytes_burst": 1e12}, "limits.global_bytes_burst: 1e+12 is not allowed"),
        ({"rule": [{"topic": "T", "rate": 1, "tag": "\ud800"}]}, "limits.rule[0].tag: '\\ud800' is not allowed"),
    ]
    for raw, msg in bad:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            parse_limits(raw)
    sec2 = upsert(sec, LimitRule("orders", "vip", rate=9))
    assert [r.rate for r in sec2.rules if r.key == ("orders", "vip")] == [9]
    assert len(remove(sec2, "logs-*", None).rules) == 1
    with pytest.raises(ConfigError, match="no limit rule"):
        remove(sec2, "nope", None)


# Buckets keyed by rule identity ------------------------------------------------------------------

def _slot_bytes(path, slot: int) -> bytes:
    from rmqfast._args import SHM_HEADER_BYTES
    from rmqfast.limits._limiter_py import SLOT_BYTES

    data = path.read_bytes()
    return data[SHM_HEADER_BYTES + slot * SLOT_BYTES : SHM_HEADER_BYTES + (slot + 1) * SLOT_BYTES]


def _spend(lim, topics, t=T0):
    for topic in topics:
        while lim.admit(topic, None, 1, 0, t) == -1:  # empty the bucket
            pass


LIVE_RULES = [{"topic": "a", "rate": 1, "burst": 3}, {"topic": "b", "rate": 2, "burst": 3},
              {"topic": "c", "rate": 3, "burst": 3}, {"topic": "d", "rate": 4, "burst": 3, "tag": "x"}]


def _live(tmp_path, rules_raw):
    """The supervisor's side (file, configuration) and one worker's limiter over it."""
    from rmqfast.limits import create_shared, open_limiter

    path = create_shared(tmp_path)
    sec = parse_limits({"global_rate": 1000, "global_burst": 1000, "rule": rules_raw})
    lim = open_limiter(path)
    lim.configure(sec.limiter_rules())
    return path, sec, lim


def _reload(path, lim, old, new_raw):
    """What the supervisor does on SIGHUP (inherit slots, reset changed buckets) and the worker after."""
    from rmqfast.limits import reset_changed

    new = parse_limits(new_raw)
    new.inherit_slots(old)
    reset = reset_changed(path, old, new)
    lim.configure(LimitsSection.from_dict(new.to_dict()).limiter_rules())  # the worker reads config.json
    return new, reset


def test_deleting_a_middle_rule_keeps_every_other_bucket(tmp_path):
    path, sec, lim = _live(tmp_path, LIVE_RULES)
    _spend(lim, [b"a", b"b", b"c"])
    lim.admit(b"d", b"x", 1, 0, T0)
    slots = {r.key: r.slot for r in sec.rules}
    before = {k: _slot_bytes(path, s) for k, s in slots.items()}
    global_before = _slot_bytes(path, 0)
    assert all(b != bytes(64) for b in before.values())  # every rule's bucket holds state
    new, reset = _reload(path, lim, sec, {"global_rate": 1000, "global_burst": 1000,
                                          "rule": [LIVE_RULES[0], LIVE_RULES[2], LIVE_RULES[3]]})
    assert reset == [slots[("b", None)]]  # only the removed rule's slot is cleared
    assert {r.key: r.slot for r in new.rules} == {k: s for k, s in slots.items() if k != ("b", None)}
    for key in (("a", None), ("c", None), ("d", "x")):
        assert _slot_bytes(path, slots[key]) == before[key], key  # byte for byte
    assert _slot_bytes(path, 0) == global_before
    # and the limiter sees it: c's bucket is still empty (was refilled when slots were positions)
    assert lim.admit(b"c", None, 1, 0, T0) == 1  # rejected by rule index 1 (c is now second)


def test_adding_a_rule_gives_it_a_fresh_bucket_and_touches_no_other(tmp_path):
    path, sec, lim = _live(tmp_path, LIVE_RULES)
    _spend(lim, [b"a", b"b", b"c"])
    before = path.read_bytes()
    new_rule = {"topic": "e", "rate": 5, "burst": 2}
    # inserted first: position 1 belonged to "a"; identity keeps "a" on its slot
    new, reset = _reload(path, lim, sec, {"global_rate": 1000, "global_burst": 1000,
                                          "rule": [new_rule, *LIVE_RULES]})
    e_slot = next(r.slot for r in new.rules if r.topic == "e")
    assert e_slot not in {r.slot for r in sec.rules} and reset == [e_slot]
    assert path.read_bytes() == before  # the new slot was already zero; nothing else changed
    assert [lim.admit(b"e", None, 1, 0, T0) for _ in range(3)] == [-1, -1, 0]
    assert lim.admit(b"a", None, 1, 0, T0) == 1  # a's bucket is still empty


def test_changing_a_rate_resets_only_that_bucket(tmp_path):
    path, sec, lim = _live(tmp_path, LIVE_RULES)
    _spend(lim, [b"a", b"b", b"c"])
    slots = {r.topic: r.slot for r in sec.rules}
    before = {t: _slot_bytes(path, s) for t, s in slots.items()}
    changed = [dict(r) for r in LIVE_RULES]
    changed[1]["rate"] = 20
    new, reset = _reload(path, lim, sec, {"global_rate": 1000, "global_burst": 1000, "rule": changed})
    assert reset == [slots["b"]] and _slot_bytes(path, slots["b"]) == bytes(64)
    for t in ("a", "c", "d"):
        assert _slot_bytes(path, slots[t]) == before[t]
    assert lim.admit(b"b", None, 1, 0, T0) == -1  # a new rate starts from a full bucket
    assert lim.admit(b"a", None, 1, 0, T0) == 0


def test_admin_changes_keep_slots_and_never_share_one():
    sec = parse_limits({"rule": LIVE_RULES})
    slots = {r.key: r.slot for r in sec.rules}
    sec2 = remove(sec, "b", None)
    assert {r.key: r.slot for r in sec2.rules} == {k: s for k, s in slots.items() if k != ("b", None)}
    sec3 = upsert(sec2, LimitRule("f", rate=1))
    f_slot = next(r.slot for r in sec3.rules if r.topic == "f")
    assert f_slot not in slots.values()  # not b's freed slot: a worker may still charge it until it reloads
    sec4 = upsert(sec3, LimitRule("a", rate=7))  # replacing a rule keeps its slot (the reset follows the rate)
    assert next(r.slot for r in sec4.rules if r.topic == "a") == slots[("a", None)]
    assert len({r.slot for r in sec4.rules}) == len(sec4.rules)
    # 1023 rules fill every slot exactly once, even after churn
    big = parse_limits({"rule": [{"topic": f"t{i}", "rate": 1} for i in range(1023)]})
    big = upsert(remove(big, "t5", None), LimitRule("new", rate=1))
    assert sorted(r.slot for r in big.rules) == list(range(1, 1024))
    with pytest.raises(ConfigError, match="share bucket slot"):
        LimitsSection(rules=[LimitRule("x", rate=1, slot=3), LimitRule("y", rate=1, slot=3)]).limiter_rules()


# One locking per shared file ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_a_limiter_of_the_other_twin_refuses_the_shared_file(tmp_path, kind):
    from rmqfast.errors import TwinMismatchError
    from rmqfast.limits import create_shared, open_limiter, shared_implementation
    from rmqfast.limits.worker import WorkerLimits

    if LimiterC is None:
        pytest.skip("compiled extension not built")
    path = create_shared(tmp_path, kind)
    assert shared_implementation(path) == kind
    own = open_limiter(path)  # the file's own twin attaches
    assert codec.is_compiled(own) == (kind == "compiled")
    with pytest.raises(TwinMismatchError, match=f"created for the '{kind}' limiter.*lose updates"):
        open_limiter(path, compiled=kind != "compiled")
    limits = WorkerLimits(path, parse_limits({"rule": [{"topic": "T", "rate": 1}]}))
    with pytest.raises(TwinMismatchError):
        limits.limiter_for(kind != "compiled")
    assert codec.is_compiled(limits.release_limiter()) == (kind == "compiled")
    # anonymous memory follows the same rule
    other = LimiterPy if kind == "compiled" else LimiterC
    with pytest.raises(TwinMismatchError):
        other(new_shared_memory(kind))


def test_a_file_without_the_header_is_refused(tmp_path):
    from rmqfast.limits import SHM_BYTES, open_limiter

    path = tmp_path / "limits.shm"
    path.write_bytes(bytes(SHM_BYTES))  # the old layout: buckets from byte 0, no header
    with pytest.raises(ValueError, match="not a shared limiter bucket file"):
        open_limiter(path)
    for L in [LimiterPy] + ([LimiterC] if LimiterC is not None else []):
        with pytest.raises(ValueError, match="no rmqfast bucket header"):
            open_limiter(path, compiled=L is not LimiterPy)


def _supervisor_cfg(tmp_path, rules_raw):
    """A configuration for an in-process Supervisor: its state under ``tmp_path``, these rules."""
    from rmqfast.config import Config

    cfg = Config()
    cfg.proxy.state_dir = str(tmp_path / "state")
    cfg.limits = parse_limits({"rule": rules_raw})
    return cfg


def test_the_supervisors_reload_and_admin_changes_keep_unchanged_buckets(tmp_path):
    """The real supervisor paths (SIGHUP reload, admin change) with a worker's limiter reading
    config.json, as a worker does after the SIGHUP."""
    import shutil

    from rmqfast import config as config_mod
    from rmqfast.limits import open_limiter
    from rmqfast.limits.worker import WorkerLimits
    from rmqfast.server.supervisor import Supervisor

    def cfg_with(rules_raw):
        return _supervisor_cfg(tmp_path, rules_raw)

    pending = {}
    sup = Supervisor(cfg_with(LIVE_RULES), lambda: pending["cfg"])
    try:
        sup._write_config()
        worker_cfg = lambda: config_mod.from_json((sup.runtime / "config.json").read_text())  # noqa: E731
        limits = WorkerLimits(sup.limits_shm, worker_cfg().limits)
        lim = limits.limiter_for()
        assert type(lim) is type(open_limiter(sup.limits_shm))  # the supervisor's twin
        _spend(lim, [b"a", b"b", b"c"])
        snap = {r.topic: _slot_bytes(sup.limits_shm, r.slot) for r in sup.cfg.limits.rules}
        # SIGHUP with the middle rule deleted and a new rule first
        pending["cfg"] = cfg_with([{"topic": "z", "rate": 9}, LIVE_RULES[0], LIVE_RULES[2], LIVE_RULES[3]])
        sup._reload()
        assert sup.cfg is pending["cfg"]
        limits.configure(worker_cfg().limits)
        slots = {r.topic: r.slot for r in sup.cfg.limits.rules}
        assert slots["z"] not in {1, 2, 3, 4}
        for t in ("a", "c", "d"):
            assert _slot_bytes(sup.limits_shm, slots[t]) == snap[t], t
        assert lim.admit(b"c", None, 1, 0, T0) == 2 and lim.admit(b"a", None, 1, 0, T0) == 1  # still empty
        # admin PUT of a changed rate: only that bucket starts full
        assert sup.change_limits(lambda cur: upsert(cur, LimitRule("c", rate=30, burst=3)), timeout=0) is False
        sup._apply_limits_update()  # what the main loop does next
        limits.configure(worker_cfg().limits)
        assert {r.topic: r.slot for r in sup.cfg.limits.rules} == slots
        assert _slot_bytes(sup.limits_shm, slots["c"]) == bytes(64)
        assert _slot_bytes(sup.limits_shm, slots["a"]) == snap["a"]
        assert lim.admit(b"c", None, 1, 0, T0) == -1 and lim.admit(b"a", None, 1, 0, T0) == 1
    finally:
        shutil.rmtree(sup.runtime, ignore_errors=True)


def test_an_admin_change_queued_before_a_reload_is_applied_on_the_reloaded_limits(tmp_path):
    """A PUT that arrives just before a SIGHUP: the reload's rules stay (the change is computed
    from the limits in force when the main loop applies it, after the reload), and the PUT's
    rule is in force too.  A bad change queued with it fails alone, for its own caller."""
    import shutil
    import threading

    from rmqfast.server.supervisor import Supervisor

    def cfg_with(rules_raw):
        return _supervisor_cfg(tmp_path, rules_raw)

    pending = {}
    sup = Supervisor(cfg_with([{"topic": "a", "rate": 1}]), lambda: pending["cfg"])
    try:
        sup._write_config()
        assert sup.change_limits(lambda cur: upsert(cur, LimitRule("http-old", rate=2)), timeout=0) is False
        sup._apply_limits_update()
        assert {r.topic for r in sup.cfg.limits.rules} == {"a", "http-old"}
        results: dict[str, object] = {}

        def put(name, change):
            try:
                results[name] = sup.change_limits(change, timeout=30)
            except ConfigError as exc:
                results[name] = exc

        threads = [threading.Thread(target=put, args=("good", lambda cur: upsert(cur, LimitRule("http-new", rate=3)))),
                   threading.Thread(target=put, args=("bad", lambda cur: remove(cur, "no-such-topic", None)))]
        for t in threads:
            t.start()
        deadline = __import__("time").monotonic() + 30
        while len(sup._limit_changes) < 2:  # both queued
            assert __import__("time").monotonic() < deadline
            threading.Event().wait(0.01)
        # the SIGHUP comes now, with a file that has its own new rule; the main loop's step order
        pending["cfg"] = cfg_with([{"topic": "a", "rate": 1}, {"topic": "from-file", "rate": 4}])
        sup._reload()
        sup._apply_limits_update()
        for t in threads:
            t.join(30)
        assert results["good"] is True
        assert isinstance(results["bad"], ConfigError) and "no limit rule" in str(results["bad"])
        # the file's rules and the new PUT; the change made before the reload is gone with it
        assert {r.topic for r in sup.cfg.limits.rules} == {"a", "from-file", "http-new"}
    finally:
        shutil.rmtree(sup.runtime, ignore_errors=True)
