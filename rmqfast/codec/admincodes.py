"""Read-only admin request codes (``policy.preset = "read-only-admin"``).

Checked against ``org.apache.rocketmq.remoting.protocol.RequestCode`` of RocketMQ 5.3.3 (javap
of rocketmq-remoting-5.3.3.jar) and the mqadmin commands that send them.  Each code only reads
state; none creates, updates, deletes, resets or re-delivers anything.  Left out on purpose:
every UPDATE_*/DELETE_*/RESET_*/WIPE_*/CLEAN_* code, CONSUME_MESSAGE_DIRECTLY (309, re-consumes a
message), UPDATE_AND_GET_GROUP_FORBIDDEN (353, writes), the AUTH_* codes (they return users and
their secrets) and the controller codes (sent to a controller, not through this proxy).
"""

from __future__ import annotations

#: Broker codes, by RocketMQ's name: the mqadmin commands that need them in the comments.
READ_ONLY_BROKER: dict[str, int] = {
    "QUERY_BROKER_OFFSET": 13,
    "GET_ALL_TOPIC_CONFIG": 21,  # topicList -c, getBrokerConfig
    "GET_TOPIC_CONFIG_LIST": 22,
    "GET_TOPIC_NAME_LIST": 23,
    "GET_BROKER_CONFIG": 26,  # getBrokerConfig
    "GET_BROKER_RUNTIME_INFO": 28,  # clusterList, brokerStatus
    "GET_ALL_CONSUMER_OFFSET": 43,
    "GET_ALL_DELAY_OFFSET": 45,
    "GET_CLIENT_CONFIG": 47,
    "GET_TIMER_CHECK_POINT": 60,
    "GET_TIMER_METRICS": 61,
    "GET_ALL_SUBSCRIPTIONGROUP_CONFIG": 201,
    "GET_TOPIC_STATS_INFO": 202,  # topicStatus
    "GET_CONSUMER_CONNECTION_LIST": 203,  # consumerConnection, consumerProgress
    "GET_PRODUCER_CONNECTION_LIST": 204,  # producerConnection
    "GET_CONSUME_STATS": 208,  # consumerProgress
    "INVOKE_BROKER_TO_GET_CONSUMER_STATUS": 223,
    "QUERY_TOPIC_CONSUME_BY_WHO": 300,  # queryMsgById's consume tracks, topicRoute
    "QUERY_CONSUME_TIME_SPAN": 303,
    "GET_SYSTEM_TOPIC_LIST_FROM_BROKER": 305,
    "GET_CONSUMER_RUNNING_INFO": 307,  # consumerStatus (the broker asks the client)
    "QUERY_CORRECTION_OFFSET": 308,
    "VIEW_BROKER_STATS_DATA": 315,  # statsAll
    "GET_BROKER_CONSUME_STATS": 317,  # brokerConsumeStats
    "QUERY_CONSUME_QUEUE": 321,  # queryCq
    "QUERY_DATA_VERSION": 322,
    "GET_ALL_PRODUCER_INFO": 328,
    "QUERY_TOPICS_BY_CONSUMER": 343,
    "QUERY_SUBSCRIPTION_BY_CONSUMER": 345,
    "GET_TOPIC_CONFIG": 351,
    "GET_SUBSCRIPTIONGROUP_CONFIG": 352,
    "GET_ALL_MESSAGE_REQUEST_MODE": 402,
    "GET_BROKER_MEMBER_GROUP": 901,
    "GET_BROKER_HA_STATUS": 907,  # haStatus
    "GET_COLD_DATA_FLOW_CTR_INFO": 2003,
}

#: Name-server codes (GET_KV_CONFIG, GET_ROUTEINFO_BY_TOPIC, GET_BROKER_CLUSTER_INFO are data plane).
READ_ONLY_NAMESRV: dict[str, int] = {
    "GET_ALL_TOPIC_LIST_FROM_NAMESERVER": 206,  # topicList
    "GET_KVLIST_BY_NAMESPACE": 219,
    "GET_TOPICS_BY_CLUSTER": 224,
    "GET_SYSTEM_TOPIC_LIST_FROM_NS": 304,
    "GET_UNIT_TOPIC_LIST": 311,
    "GET_HAS_UNIT_SUB_TOPIC_LIST": 312,
    "GET_HAS_UNIT_SUB_UNUNIT_TOPIC_LIST": 313,
    "GET_NAMESRV_CONFIG": 319,
    "QUERY_DATA_VERSION": 322,
}

#: Codes a preset adds to the allowlist, per listener role.
PRESETS: dict[str, dict[str, frozenset[int]]] = {
    "read-only-admin": {
        "broker": frozenset(READ_ONLY_BROKER.values()),
        "namesrv": frozenset(READ_ONLY_NAMESRV.values()),
    },
}


def preset_codes(preset: str, role: str) -> frozenset[int]:
    """The codes ``preset`` allows on listeners of ``role`` (nothing for ``""``)."""
    if not preset:
        return frozenset()
    try:
        return PRESETS[preset][role]
    except KeyError:
        raise ValueError(
            f"policy.preset {preset!r} is unknown; known presets: {', '.join(sorted(PRESETS))}"
        ) from None
