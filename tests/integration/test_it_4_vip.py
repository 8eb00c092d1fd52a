"""Old clients' VIP channel (broker port - 2) keeps working through the proxy.

Java clients up to 4.4.0 enable the VIP channel by default and send to the broker's port - 2;
rmqfast listens on endpoint - 2 and relays to the real broker's port - 2.  The 4.9.4 client
with ``setVipChannelEnabled(true)`` behaves the same way.
"""

from __future__ import annotations

import pytest
from itutil import assert_roundtrip, drive, unique, wait_metric

from rmqfast.testing.proxy import ProxyProcess

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("client", ["4", "5"])
def test_vip_channel_roundtrip(proxy: ProxyProcess, client: str) -> None:
    topic = unique(f"vip{client}")
    res = drive(
        "roundtrip",
        proxy.namesrv_addr,
        client,
        topic=topic,
        count=20,
        mode="sync",
        vip_channel=True,
        timeout_ms=30000,
        settle_ms=500,
        timeout=60,
    )
    assert_roundtrip(res, 20)
    # Workers publish their counters once a second: poll rather than read once.
    wait_metric(proxy, "rmqfast_topic_messages_total", 20, topic=topic)
