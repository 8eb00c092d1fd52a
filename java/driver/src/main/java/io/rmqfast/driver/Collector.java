package io.rmqfast.driver;

import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;

import org.apache.rocketmq.common.message.MessageClientExt;
import org.apache.rocketmq.common.message.MessageConst;
import org.apache.rocketmq.common.message.MessageExt;

/** Thread-safe record of every delivery a consumer saw, and the decision whether to ack it. */
final class Collector {
    /** Print one line per delivery on stderr (--trace-deliveries). */
    static volatile boolean trace;

    private final long t0;
    private final String onlyRun;
    private final int failEvery;
    private final int maxBodyPrint;
    private final List<Map<String, Object>> deliveries = new ArrayList<>();
    /** key -> number of successful consumptions. */
    private final Map<String, Integer> okCount = new LinkedHashMap<>();
    private final Set<String> retried = new LinkedHashSet<>();
    /** shard -> idx in successful-consumption order. */
    private final Map<String, List<Integer>> byShard = new TreeMap<>();
    private final Set<String> queues = new LinkedHashSet<>();
    private int foreign;

    Collector(long t0, String onlyRun, int failEvery, int maxBodyPrint) {
        this.t0 = t0;
        this.onlyRun = onlyRun;
        this.failEvery = failEvery;
        this.maxBodyPrint = maxBodyPrint;
    }

    static String key(MessageExt m) {
        String run = m.getUserProperty("run");
        String idx = m.getUserProperty("idx");
        if (run != null && idx != null) {
            return run + ":" + idx;
        }
        return m.getMsgId();
    }

    /**
     * Records a delivery; returns true to acknowledge it, false to ask for redelivery
     * (only when --fail-every selects the message and this is its first delivery).
     */
    synchronized boolean onMessage(MessageExt m, String brokerName, String via) {
        String run = m.getUserProperty("run");
        if (onlyRun != null && !onlyRun.equals(run)) {
            foreign++;
            return true;
        }
        Map<String, Object> r = describe(m, brokerName, maxBodyPrint);
        r.put("via", via);
        r.put("recv_ms", System.currentTimeMillis() - t0);
        r.put("recv_epoch_ms", System.currentTimeMillis());
        Integer idx = (Integer) r.get("idx");
        boolean ack = true;
        if (failEvery > 0 && idx != null && Math.floorMod(idx, failEvery) == 0 && m.getReconsumeTimes() == 0) {
            ack = false;
        }
        r.put("acked", ack);
        deliveries.add(r);
        if (trace) {
            System.err.println("DELIVERED " + r.get("run") + ":" + idx + " " + r.get("broker_name") + ":"
                + r.get("queue_id") + " " + r.get("recv_epoch_ms"));
        }
        String k = key(m);
        queues.add(r.get("broker_name") + ":" + r.get("queue_id"));
        if (ack) {
            okCount.merge(k, 1, Integer::sum);
            String shard = m.getUserProperty("shard");
            if (shard != null && idx != null) {
                byShard.computeIfAbsent(shard, s -> new ArrayList<>()).add(idx);
            }
        } else {
            retried.add(k);
        }
        return ack;
    }

    synchronized int distinctOk() {
        return okCount.size();
    }

    synchronized Set<String> okKeys() {
        return new LinkedHashSet<>(okCount.keySet());
    }

    synchronized List<Map<String, Object>> deliveries() {
        return new ArrayList<>(deliveries);
    }

    synchronized void report(Map<String, Object> out) {
        out.put("received", new ArrayList<>(deliveries));
        out.put("deliveries", deliveries.size());
        out.put("distinct", okCount.size());
        List<String> dups = new ArrayList<>();
        for (Map.Entry<String, Integer> e : okCount.entrySet()) {
            if (e.getValue() > 1) {
                dups.add(e.getKey());
            }
        }
        out.put("duplicates", dups);
        out.put("retried", new ArrayList<>(retried));
        out.put("foreign", foreign);
        out.put("queues_seen", new ArrayList<>(queues));
        Map<String, Object> order = new LinkedHashMap<>();
        Map<String, Object> inOrder = new LinkedHashMap<>();
        for (Map.Entry<String, List<Integer>> e : byShard.entrySet()) {
            order.put(e.getKey(), e.getValue());
            boolean ok = true;
            List<Integer> l = e.getValue();
            for (int i = 1; i < l.size(); i++) {
                if (l.get(i) <= l.get(i - 1)) {
                    ok = false;
                    break;
                }
            }
            inOrder.put(e.getKey(), ok);
        }
        out.put("order_by_shard", order);
        out.put("shard_in_order", inOrder);
    }

    static Map<String, Object> describe(MessageExt m, String brokerName, int maxBodyPrint) {
        Map<String, Object> r = new LinkedHashMap<>();
        String idx = m.getUserProperty("idx");
        Integer idxVal = null;
        if (idx != null) {
            try {
                idxVal = Integer.valueOf(idx);
            } catch (NumberFormatException ignored) {
                idxVal = null;
            }
        }
        r.put("idx", idxVal);
        r.put("run", m.getUserProperty("run"));
        r.put("msg_id", m.getMsgId());
        if (m instanceof MessageClientExt) {
            r.put("offset_msg_id", ((MessageClientExt) m).getOffsetMsgId());
        }
        r.put("topic", m.getTopic());
        r.put("tags", m.getTags());
        r.put("keys", m.getKeys());
        Spec.describeBody(r, m.getBody(), maxBodyPrint);
        Map<String, Object> user = new LinkedHashMap<>();
        Map<String, Object> sys = new TreeMap<>();
        Map<String, String> props = m.getProperties();
        if (props != null) {
            for (Map.Entry<String, String> e : props.entrySet()) {
                if (MessageConst.STRING_HASH_SET.contains(e.getKey())) {
                    sys.put(e.getKey(), e.getValue());
                } else {
                    user.put(e.getKey(), e.getValue());
                }
            }
        }
        r.put("props", user);
        r.put("sys_props", sys);
        r.put("shard", m.getUserProperty("shard"));
        r.put("queue_id", m.getQueueId());
        r.put("broker_name", brokerName != null ? brokerName : m.getBrokerName());
        r.put("queue_offset", m.getQueueOffset());
        r.put("commit_log_offset", m.getCommitLogOffset());
        r.put("reconsume_times", m.getReconsumeTimes());
        r.put("sys_flag", m.getSysFlag());
        r.put("born_host", addr(m.getBornHost()));
        r.put("store_host", addr(m.getStoreHost()));
        r.put("born_timestamp", m.getBornTimestamp());
        r.put("store_timestamp", m.getStoreTimestamp());
        r.put("delay_level", m.getDelayTimeLevel());
        return r;
    }

    private static String addr(SocketAddress a) {
        if (a instanceof InetSocketAddress) {
            InetSocketAddress i = (InetSocketAddress) a;
            String host = i.getAddress() != null ? i.getAddress().getHostAddress() : i.getHostString();
            return host + ":" + i.getPort();
        }
        return a == null ? null : a.toString();
    }
}
