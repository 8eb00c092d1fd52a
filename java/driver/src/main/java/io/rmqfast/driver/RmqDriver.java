package io.rmqfast.driver;

import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.lang.reflect.Method;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

import org.apache.rocketmq.acl.common.AclClientRPCHook;
import org.apache.rocketmq.acl.common.SessionCredentials;
import org.apache.rocketmq.client.ClientConfig;
import org.apache.rocketmq.client.consumer.DefaultLitePullConsumer;
import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.MessageSelector;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueAveragely;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.ConsumeOrderlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.client.consumer.listener.MessageListenerOrderly;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.LocalTransactionState;
import org.apache.rocketmq.client.producer.MessageQueueSelector;
import org.apache.rocketmq.client.producer.SendCallback;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.SendStatus;
import org.apache.rocketmq.client.producer.TransactionListener;
import org.apache.rocketmq.client.producer.TransactionMQProducer;
import org.apache.rocketmq.client.producer.TransactionSendResult;
import org.apache.rocketmq.common.MQVersion;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageAccessor;
import org.apache.rocketmq.common.message.MessageClientIDSetter;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageQueue;
import org.apache.rocketmq.remoting.RPCHook;

/**
 * Test traffic generator for rmqfast, built twice (rocketmq-client 5.x and 4.9.4) from this one source.
 *
 * <pre>
 * RmqDriver SCENARIO --namesrv HOST:PORT [--topic T] [options]     (--key value, --key=value, --flag)
 *
 * Scenarios
 *   version            print the client version (no network)
 *   produce            send --count messages, --mode sync|async|oneway|batch|ordered
 *   consume-push       DefaultMQPushConsumer until --expect distinct messages were acked (or timeout)
 *   consume-litepull   DefaultLitePullConsumer subscribe + poll, same output
 *   transaction        TransactionMQProducer; UNKNOW for some messages so the broker checks back;
 *                      a push consumer (started first) verifies what was committed
 *   roundtrip          consumer (--consumer push|litepull) started, then produce --mode, then compare
 *   queues             the topic's publish queues as the client sees them
 *
 * Common       --group G (default rmqfast_SCENARIO_RUNID; roundtrip/transaction add _p/_c/_tx)
 *              --run-id ID  --instance-name N  --namespace NS  --unit-name U
 *              --poll-ns-ms 1000  --heartbeat-ms 1000  --persist-offset-ms 1000  --api-timeout-ms 3000
 *              --rebalance-ms 1000  --rebalance-min-ms 200  --lock-interval-ms 1000
 *              --vip-channel false  --timeout-ms 30000 (45000 for transaction)  --settle-ms 500
 *              --shutdown-wait-ms 1500  --max-body-print 256
 *              --access-key AK --secret-key SK [--security-token T]: sign every request (AclClientRPCHook)
 * Producing    --count 10  --start-index 0  --mode sync  --tags TagA,TagB,TagC ("" = no tag)
 *              --shard-keys K (default 4 for ordered)  --body-size B  --body-kind repeat|hex
 *              --unicode  --props k=v,k2=v2  --delay-level L  --batch-size 10  --async-inflight 64
 *              --delay-prop TIMER_DELIVER_MS|TIMER_DELAY_SEC|TIMER_DELAY_MS|__STARTDELIVERTIME
 *              --delay-ms 5000  --delay-step-ms 0 (message k asks for delay-ms + k * delay-step-ms)
 *              --send-timeout-ms 5000  --retries 2  --queues 4 (new-topic queues)  --compress-over N
 *              --max-message-size N  --oneway-linger-ms 300  --allow-failures
 * Consuming    --expect N (default --count)  --sub "TagA || TagB" | --sql "idx IS NOT NULL"
 *              --orderly  --broadcast  --from CONSUME_FROM_FIRST_OFFSET  --only-run RUNID
 *              --fail-every K (first delivery of idx%K==0 is refused: RECONSUME_LATER / SUSPEND)
 *              --retry-delay-level 1  --max-reconsume 16  --suspend-ms 200  --consume-threads 4
 *              --pull-batch-size 32  --poll-ms 200  --commit-interval-ms 1000  --metadata-check-ms 1000
 *              --stop-file PATH (consume-push/litepull end once it exists)  --trace-deliveries (a
 *              "DELIVERED run:idx broker:queue epoch_ms" line on stderr per delivery, for consumers killed mid-run)
 * Transaction  --count 6  --unknown-every 2 (idx%U==U-1 answers UNKNOW)  --rollback-every 0
 *              --check-result commit|rollback|unknown  --consume true  --consumer push|litepull
 * </pre>
 *
 * Every message has body "rmq|RUN|IDX|..." (padded to --body-size), KEYS "key-RUN-IDX alt-IDX",
 * a round-robin tag and user properties p1=vIDX, idx=IDX, run=RUN (+ shard=sK when sharded).
 * Exactly one JSON object is written to stdout at the end; everything else goes to stderr.
 * Exit codes: 0 ok, 1 error, 2 send failures, 3 consumer timed out / expectations not met, 64 usage.
 */
public final class RmqDriver {
    static final long T0 = System.currentTimeMillis();
    static final int EXIT_OK = 0;
    static final int EXIT_ERROR = 1;
    static final int EXIT_SEND_FAILED = 2;
    static final int EXIT_INCOMPLETE = 3;
    static final int EXIT_USAGE = 64;

    private final Opts o;
    private final String scenario;
    private final String namesrv;
    private final String runId;
    private final String instance;
    private final int maxBodyPrint;

    private RmqDriver(Opts o) {
        this.o = o;
        this.scenario = o.scenario;
        this.namesrv = o.str("namesrv", null);
        this.runId = o.str("run-id", Long.toHexString(System.nanoTime() ^ (ProcessHandle.current().pid() << 32)));
        this.instance = o.str("instance-name", "rmqdrv" + ProcessHandle.current().pid() + "_" + runId);
        this.maxBodyPrint = o.integer("max-body-print", 256);
    }

    static void log(String fmt, Object... args) {
        System.err.printf("[rmqdriver +%dms] %s%n", System.currentTimeMillis() - T0, String.format(fmt, args));
        System.err.flush();
    }

    public static void main(String[] args) {
        PrintStream out = new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);
        // Nothing but our JSON may reach stdout (client logging sometimes prints to System.out).
        System.setOut(System.err);
        Map<String, Object> result = new LinkedHashMap<>();
        int code;
        try {
            Opts o = new Opts(args);
            // Must be set before the client classes that read them are loaded.
            System.setProperty("rocketmq.client.rebalance.waitInterval", o.str("rebalance-ms", "1000"));
            System.setProperty("rocketmq.client.rebalance.minInterval", o.str("rebalance-min-ms", "200"));
            // 4.9.x marks a newly assigned orderly queue as locked only on the periodic re-lock (20 s default)
            System.setProperty("rocketmq.client.rebalance.lockInterval", o.str("lock-interval-ms", "1000"));
            RmqDriver d = new RmqDriver(o);
            result.put("scenario", o.scenario);
            code = d.run(result);
            List<String> unused = o.unused();
            if (!unused.isEmpty()) {
                result.put("unused_options", unused);
                log("warning: unused options %s", unused);
            }
        } catch (IllegalArgumentException e) {
            result.put("error", "usage: " + e.getMessage());
            code = EXIT_USAGE;
        } catch (Throwable t) {
            StringWriter sw = new StringWriter();
            t.printStackTrace(new PrintWriter(sw));
            result.put("error", t.toString());
            result.put("stack", sw.toString());
            System.err.println(sw);
            code = EXIT_ERROR;
        }
        result.put("ok", code == EXIT_OK);
        result.put("exit_code", code);
        result.put("elapsed_ms", System.currentTimeMillis() - T0);
        out.println(Json.write(result));
        out.flush();
        System.err.flush();
        // Client threads (netty, timers) are not all daemons; leave without waiting for them.
        Runtime.getRuntime().halt(code);
    }

    private int run(Map<String, Object> result) throws Exception {
        result.put("client_version", MQVersion.getVersionDesc(MQVersion.CURRENT_VERSION));
        result.put("client_major", clientMajor());
        if (scenario.equals("version")) {
            return EXIT_OK;
        }
        if (namesrv == null) {
            throw new IllegalArgumentException("missing required option --namesrv");
        }
        result.put("namesrv", namesrv);
        result.put("run_id", runId);
        switch (scenario) {
            case "produce":
                return produceScenario(result);
            case "perf-produce":
                return perfProduceScenario(result);
            case "consume-push":
                return consumeScenario(result, "push");
            case "consume-litepull":
                return consumeScenario(result, "litepull");
            case "transaction":
                return transactionScenario(result);
            case "roundtrip":
                return roundtripScenario(result);
            case "queues":
                return queuesScenario(result);
            default:
                throw new IllegalArgumentException("unknown scenario " + scenario);
        }
    }

    /**
     * Runs a client's shutdown() but waits at most --shutdown-wait-ms for it: the client has sent its
     * UNREGISTER_CLIENT / offset updates by the time its netty threads linger (5.x waits ~3 s for an
     * idle event thread), and the JVM halts at the end anyway.
     */
    private void shutdown(String what, Runnable r) {
        long maxMs = o.lng("shutdown-wait-ms", 1500);
        Thread t = new Thread(() -> {
            try {
                r.run();
            } catch (RuntimeException e) {
                log("%s shutdown failed: %s", what, e);
            }
        }, "rmqdriver-shutdown-" + what);
        t.setDaemon(true);
        t.start();
        try {
            t.join(maxMs);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
        if (t.isAlive()) {
            log("%s shutdown still running after %d ms; not waiting", what, maxMs);
        }
    }

    /** An exception and its causes (5.x wraps the broker's answer in "Send [n] times, still failed"). */
    static String errorText(Throwable e) {
        StringBuilder sb = new StringBuilder(String.valueOf(e));
        Throwable c = e.getCause();
        for (int depth = 0; c != null && c != e && depth < 5; depth++, c = c.getCause()) {
            sb.append(" <- ").append(c);
        }
        return sb.toString();
    }

    static String clientMajor() {
        String v = MQVersion.getVersionDesc(MQVersion.CURRENT_VERSION);
        // "V5_3_3" / "V4_9_4"
        return v.length() > 1 ? v.substring(1, 2) : v;
    }

    // ------------------------------------------------------------------ client setup

    private void configure(ClientConfig c, String role) {
        c.setNamesrvAddr(namesrv);
        c.setInstanceName(instance + "_" + role);
        c.setPollNameServerInterval(o.integer("poll-ns-ms", 1000));
        c.setHeartbeatBrokerInterval(o.integer("heartbeat-ms", 1000));
        c.setPersistConsumerOffsetInterval(o.integer("persist-offset-ms", 1000));
        c.setVipChannelEnabled(o.bool("vip-channel", false));
        c.setMqClientApiTimeout(o.integer("api-timeout-ms", 3000));
        if (o.has("namespace")) {
            c.setNamespace(o.str("namespace", null));
        }
        if (o.has("unit-name")) {
            c.setUnitName(o.str("unit-name", null));
        }
    }

    private String topic() {
        return o.required("topic");
    }

    /** AclClientRPCHook when --access-key is given (ACL-enabled brokers), else null (no hook). */
    private RPCHook rpcHook() {
        if (!o.has("access-key")) {
            return null;
        }
        SessionCredentials cred = new SessionCredentials(o.required("access-key"), o.required("secret-key"));
        if (o.has("security-token")) {
            cred.setSecurityToken(o.str("security-token", null));
        }
        return new AclClientRPCHook(cred);
    }

    private String group(String suffix) {
        String g = o.str("group", null);
        if (g == null) {
            g = "rmqfast_" + scenario.replace('-', '_') + "_" + runId;
        }
        return suffix.isEmpty() ? g : g + suffix;
    }

    private DefaultMQProducer newProducer(DefaultMQProducer p) {
        configure(p, "producer");
        p.setSendMsgTimeout(o.integer("send-timeout-ms", 5000));
        int retries = o.integer("retries", 2);
        p.setRetryTimesWhenSendFailed(retries);
        p.setRetryTimesWhenSendAsyncFailed(retries);
        p.setDefaultTopicQueueNums(o.integer("queues", 4));
        if (o.has("compress-over")) {
            p.setCompressMsgBodyOverHowmuch(o.integer("compress-over", 4096));
        }
        if (o.has("max-message-size")) {
            p.setMaxMessageSize(o.integer("max-message-size", 4 * 1024 * 1024));
        }
        return p;
    }

    private Spec.Plan plan() {
        Spec.Plan p = new Spec.Plan();
        p.runId = runId;
        List<String> tags = o.list("tags", "TagA,TagB,TagC");
        if (tags.size() == 1 && tags.get(0).isEmpty()) {
            tags = new ArrayList<>();
        }
        p.tags = tags;
        p.shardKeys = o.integer("shard-keys", "ordered".equals(o.str("mode", "sync")) ? 4 : 0);
        p.bodySize = o.integer("body-size", 0);
        p.bodyKind = o.str("body-kind", "repeat");
        p.unicode = o.bool("unicode", false);
        for (String kv : o.list("props", "")) {
            if (kv.isEmpty()) {
                continue;
            }
            int eq = kv.indexOf('=');
            if (eq <= 0) {
                throw new IllegalArgumentException("--props wants k=v,k2=v2; got " + kv);
            }
            p.extraProps.put(kv.substring(0, eq), kv.substring(eq + 1));
        }
        return p;
    }

    // ------------------------------------------------------------------ produce

    private static final class SendOutcome {
        final List<Map<String, Object>> sent = new ArrayList<>();
        final List<Map<String, Object>> failed = new ArrayList<>();
        final Map<Integer, Spec> specs = new LinkedHashMap<>();
    }

    /**
     * --delay-prop NAME (TIMER_DELIVER_MS, TIMER_DELAY_SEC, TIMER_DELAY_MS or __STARTDELIVERTIME) with
     * --delay-ms D and --delay-step-ms S: message k of the run asks to be delivered D + k*S ms after it is
     * built (set as the client sets it: Message.setDeliverTimeMs / setDelayTimeSec / setDelayTimeMs in 5.x, which
     * 4.9.4 lacks, hence MessageAccessor); the user property due_ms holds that time (epoch ms) for the consumer to compare.
     */
    private void applyDeliveryTime(Message m, int k) {
        String prop = o.str("delay-prop", null);
        if (prop == null) {
            return;
        }
        long after = o.lng("delay-ms", 5000) + k * o.lng("delay-step-ms", 0);
        long now = System.currentTimeMillis();
        switch (prop) {
            case "TIMER_DELAY_SEC":
                after = after / 1000 * 1000;
                MessageAccessor.putProperty(m, prop, String.valueOf(after / 1000));
                break;
            case "TIMER_DELAY_MS":
                MessageAccessor.putProperty(m, prop, String.valueOf(after));
                break;
            default:
                MessageAccessor.putProperty(m, prop, String.valueOf(now + after));
        }
        m.putUserProperty("due_ms", String.valueOf(now + after));
    }

    private static void putResult(Map<String, Object> rec, SendResult r) {
        rec.put("status", r.getSendStatus() == null ? null : r.getSendStatus().name());
        rec.put("msg_id", r.getMsgId());
        rec.put("offset_msg_id", r.getOffsetMsgId());
        MessageQueue mq = r.getMessageQueue();
        rec.put("broker_name", mq == null ? null : mq.getBrokerName());
        rec.put("queue_id", mq == null ? null : mq.getQueueId());
        rec.put("queue_offset", r.getQueueOffset());
    }

    private SendOutcome produce(DefaultMQProducer p, String topic, String mode, int start, int count,
                                Spec.Plan plan) throws Exception {
        SendOutcome out = new SendOutcome();
        int delayLevel = o.integer("delay-level", 0);
        long timeoutMs = o.lng("timeout-ms", 30000);
        log("producing %d messages to %s (mode=%s, run=%s)", count, topic, mode, runId);
        List<Spec> specs = new ArrayList<>();
        for (int i = start; i < start + count; i++) {
            Spec s = plan.make(i);
            specs.add(s);
            out.specs.put(i, s);
        }
        switch (mode) {
            case "sync":
            case "ordered": {
                MessageQueueSelector selector = (mqs, msg, arg) -> mqs.get(Math.floorMod(arg.hashCode(), mqs.size()));
                for (Spec s : specs) {
                    Message m = s.toMessage(topic);
                    if (delayLevel > 0) {
                        m.setDelayTimeLevel(delayLevel);
                    }
                    applyDeliveryTime(m, s.idx - start);
                    Map<String, Object> rec = s.describe(maxBodyPrint);
                    try {
                        SendResult r;
                        if (mode.equals("ordered")) {
                            Object key = s.shard != null ? s.shard : "s0";
                            r = p.send(m, selector, key);
                        } else {
                            r = p.send(m);
                        }
                        putResult(rec, r);
                        out.sent.add(rec);
                    } catch (Exception e) {
                        rec.put("error", errorText(e));
                        rec.put("msg_id", MessageClientIDSetter.getUniqID(m));
                        out.failed.add(rec);
                        log("send idx=%d failed: %s", s.idx, e);
                    }
                }
                break;
            }
            case "async": {
                int inflight = o.integer("async-inflight", 64);
                Semaphore sem = new Semaphore(inflight);
                CountDownLatch done = new CountDownLatch(specs.size());
                Map<Integer, Map<String, Object>> ok = new ConcurrentHashMap<>();
                Map<Integer, Map<String, Object>> bad = new ConcurrentHashMap<>();
                for (Spec s : specs) {
                    Message m = s.toMessage(topic);
                    if (delayLevel > 0) {
                        m.setDelayTimeLevel(delayLevel);
                    }
                    applyDeliveryTime(m, s.idx - start);
                    Map<String, Object> rec = s.describe(maxBodyPrint);
                    sem.acquire();
                    try {
                        p.send(m, new SendCallback() {
                            @Override
                            public void onSuccess(SendResult r) {
                                putResult(rec, r);
                                ok.put(s.idx, rec);
                                sem.release();
                                done.countDown();
                            }

                            @Override
                            public void onException(Throwable e) {
                                rec.put("error", errorText(e));
                                rec.put("msg_id", MessageClientIDSetter.getUniqID(m));
                                bad.put(s.idx, rec);
                                log("async send idx=%d failed: %s", s.idx, e);
                                sem.release();
                                done.countDown();
                            }
                        });
                    } catch (Exception e) {
                        rec.put("error", errorText(e));
                        bad.put(s.idx, rec);
                        sem.release();
                        done.countDown();
                    }
                }
                if (!done.await(timeoutMs, TimeUnit.MILLISECONDS)) {
                    log("async sends: %d callbacks still missing after %d ms", done.getCount(), timeoutMs);
                }
                for (Spec s : specs) {
                    if (ok.containsKey(s.idx)) {
                        out.sent.add(ok.get(s.idx));
                    } else if (bad.containsKey(s.idx)) {
                        out.failed.add(bad.get(s.idx));
                    } else {
                        Map<String, Object> rec = s.describe(maxBodyPrint);
                        rec.put("error", "no callback within timeout");
                        out.failed.add(rec);
                    }
                }
                break;
            }
            case "oneway": {
                for (Spec s : specs) {
                    Message m = s.toMessage(topic);
                    if (delayLevel > 0) {
                        m.setDelayTimeLevel(delayLevel);
                    }
                    applyDeliveryTime(m, s.idx - start);
                    Map<String, Object> rec = s.describe(maxBodyPrint);
                    try {
                        p.sendOneway(m);
                        rec.put("status", "ONEWAY");
                        rec.put("msg_id", MessageClientIDSetter.getUniqID(m));
                        out.sent.add(rec);
                    } catch (Exception e) {
                        rec.put("error", errorText(e));
                        out.failed.add(rec);
                    }
                }
                // let the last one-way frames leave before the channels are closed
                Thread.sleep(o.integer("oneway-linger-ms", 300));
                break;
            }
            case "batch": {
                int batchSize = o.integer("batch-size", 10);
                for (int b = 0; b < specs.size(); b += batchSize) {
                    List<Spec> chunk = specs.subList(b, Math.min(specs.size(), b + batchSize));
                    List<Message> msgs = new ArrayList<>();
                    for (Spec s : chunk) {
                        msgs.add(s.toMessage(topic));
                    }
                    try {
                        SendResult r = p.send(msgs);
                        for (int j = 0; j < chunk.size(); j++) {
                            Map<String, Object> rec = chunk.get(j).describe(maxBodyPrint);
                            putResult(rec, r);
                            rec.put("msg_id", MessageClientIDSetter.getUniqID(msgs.get(j)));
                            rec.put("batch_no", b / batchSize);
                            rec.put("batch_msg_ids", r.getMsgId());
                            rec.put("queue_offset", r.getQueueOffset() + j);
                            out.sent.add(rec);
                        }
                    } catch (Exception e) {
                        log("batch %d failed: %s", b / batchSize, e);
                        for (int j = 0; j < chunk.size(); j++) {
                            Map<String, Object> rec = chunk.get(j).describe(maxBodyPrint);
                            rec.put("error", errorText(e));
                            rec.put("batch_no", b / batchSize);
                            out.failed.add(rec);
                        }
                    }
                }
                break;
            }
            default:
                throw new IllegalArgumentException("unknown --mode " + mode + " (sync|async|oneway|batch|ordered)");
        }
        log("produced: %d ok, %d failed", out.sent.size(), out.failed.size());
        return out;
    }

    private int produceScenario(Map<String, Object> result) throws Exception {
        String topic = topic();
        String mode = o.str("mode", "sync");
        int count = o.integer("count", 10);
        int start = o.integer("start-index", 0);
        Spec.Plan plan = plan();
        DefaultMQProducer p = newProducer(new DefaultMQProducer(group(""), rpcHook()));
        result.put("topic", topic);
        result.put("group", p.getProducerGroup());
        result.put("mode", mode);
        p.start();
        SendOutcome out;
        try {
            out = produce(p, topic, mode, start, count, plan);
        } finally {
            shutdown("producer", p::shutdown);
        }
        result.put("sent", out.sent);
        result.put("failed", out.failed);
        result.put("sent_count", out.sent.size());
        result.put("failed_count", out.failed.size());
        return out.failed.isEmpty() || o.bool("allow-failures", false) ? EXIT_OK : EXIT_SEND_FAILED;
    }

    // ------------------------------------------------------------------ consume

    /** A started consumer of either kind. */
    private interface RunningConsumer {
        void pump(long maxMs) throws Exception; // litepull polls here; push just sleeps

        void shutdown();
    }

    private MessageSelector selector() {
        if (o.has("sql")) {
            return MessageSelector.bySql(o.str("sql", null));
        }
        return MessageSelector.byTag(o.str("sub", "*"));
    }

    private static void setBroadcasting(Object consumer) throws Exception {
        // MessageModel moved packages between 4.x and 5.x: set it reflectively.
        for (Method m : consumer.getClass().getMethods()) {
            if (m.getName().equals("setMessageModel") && m.getParameterCount() == 1
                && m.getParameterTypes()[0].isEnum()) {
                @SuppressWarnings({"unchecked", "rawtypes"})
                Object v = Enum.valueOf((Class) m.getParameterTypes()[0], "BROADCASTING");
                m.invoke(consumer, v);
                return;
            }
        }
        throw new IllegalStateException("no setMessageModel(enum) on " + consumer.getClass());
    }

    private ConsumeFromWhere fromWhere() {
        return ConsumeFromWhere.valueOf(o.str("from", "CONSUME_FROM_FIRST_OFFSET"));
    }

    private RunningConsumer startPush(String topic, String group, Collector col) throws Exception {
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(group, rpcHook(), new AllocateMessageQueueAveragely());
        configure(c, "push");
        c.setConsumeFromWhere(fromWhere());
        c.subscribe(topic, selector());
        c.setConsumeThreadMin(o.integer("consume-threads", 4));
        c.setConsumeThreadMax(o.integer("consume-threads", 4));
        c.setPullBatchSize(o.integer("pull-batch-size", 32));
        c.setConsumeMessageBatchMaxSize(1);
        c.setMaxReconsumeTimes(o.integer("max-reconsume", 16));
        c.setSuspendCurrentQueueTimeMillis(o.integer("suspend-ms", 200));
        c.setAwaitTerminationMillisWhenShutdown(1000);
        if (o.bool("broadcast", false)) {
            setBroadcasting(c);
        }
        int retryDelayLevel = o.integer("retry-delay-level", 1);
        if (o.bool("orderly", false)) {
            c.registerMessageListener((MessageListenerOrderly) (msgs, ctx) -> {
                String broker = ctx.getMessageQueue() == null ? null : ctx.getMessageQueue().getBrokerName();
                for (MessageExt m : msgs) {
                    if (!col.onMessage(m, broker, "push-orderly")) {
                        return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT;
                    }
                }
                return ConsumeOrderlyStatus.SUCCESS;
            });
        } else {
            c.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
                String broker = ctx.getMessageQueue() == null ? null : ctx.getMessageQueue().getBrokerName();
                for (MessageExt m : msgs) {
                    if (!col.onMessage(m, broker, "push")) {
                        ctx.setDelayLevelWhenNextConsume(retryDelayLevel);
                        return ConsumeConcurrentlyStatus.RECONSUME_LATER;
                    }
                }
                return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
            });
        }
        c.start();
        log("CONSUMER_STARTED push group=%s topic=%s orderly=%s", group, topic, o.bool("orderly", false));
        return new RunningConsumer() {
            @Override
            public void pump(long maxMs) throws InterruptedException {
                Thread.sleep(Math.max(1, maxMs));
            }

            @Override
            public void shutdown() {
                RmqDriver.this.shutdown("push-consumer", c::shutdown);
            }
        };
    }

    private RunningConsumer startLitePull(String topic, String group, Collector col) throws Exception {
        DefaultLitePullConsumer c = new DefaultLitePullConsumer(group, rpcHook());
        configure(c, "litepull");
        c.setConsumeFromWhere(fromWhere());
        c.subscribe(topic, selector());
        c.setAutoCommit(true);
        c.setAutoCommitIntervalMillis(o.integer("commit-interval-ms", 1000));
        c.setPullBatchSize(o.integer("pull-batch-size", 32));
        c.setTopicMetadataCheckIntervalMillis(o.integer("metadata-check-ms", 1000));
        c.setPollTimeoutMillis(o.integer("poll-ms", 200));
        if (o.bool("broadcast", false)) {
            setBroadcasting(c);
        }
        c.start();
        log("CONSUMER_STARTED litepull group=%s topic=%s", group, topic);
        long pollMs = o.integer("poll-ms", 200);
        return new RunningConsumer() {
            @Override
            public void pump(long maxMs) {
                long end = System.currentTimeMillis() + Math.max(1, maxMs);
                while (System.currentTimeMillis() < end) {
                    List<MessageExt> msgs = c.poll(Math.min(pollMs, Math.max(1, end - System.currentTimeMillis())));
                    if (msgs == null) {
                        continue;
                    }
                    for (MessageExt m : msgs) {
                        col.onMessage(m, m.getBrokerName(), "litepull");
                    }
                }
            }

            @Override
            public void shutdown() {
                try {
                    c.commitSync();
                } catch (RuntimeException e) {
                    log("commitSync failed: %s", e);
                }
                RmqDriver.this.shutdown("litepull-consumer", c::shutdown);
            }
        };
    }

    private RunningConsumer startConsumer(String kind, String topic, String group, Collector col) throws Exception {
        if (kind.equals("push")) {
            return startPush(topic, group, col);
        }
        if (kind.equals("litepull")) {
            return startLitePull(topic, group, col);
        }
        throw new IllegalArgumentException("unknown consumer kind " + kind + " (push|litepull)");
    }

    /** Waits until {@code done()} or timeout, pumping the consumer; then lets extra deliveries settle. */
    private boolean await(RunningConsumer c, java.util.function.BooleanSupplier done, long timeoutMs, long settleMs)
        throws Exception {
        long end = System.currentTimeMillis() + timeoutMs;
        boolean reached = done.getAsBoolean();
        while (!reached && System.currentTimeMillis() < end) {
            c.pump(Math.min(100, Math.max(1, end - System.currentTimeMillis())));
            reached = done.getAsBoolean();
        }
        if (settleMs > 0) {
            c.pump(settleMs);
        }
        return reached;
    }

    private Collector newCollector() {
        Collector.trace = o.bool("trace-deliveries", false);
        return new Collector(T0, o.str("only-run", null), o.integer("fail-every", 0), maxBodyPrint);
    }

    private int consumeScenario(Map<String, Object> result, String kind) throws Exception {
        String topic = topic();
        String group = group("");
        int expect = o.integer("expect", o.integer("count", 10));
        long timeoutMs = o.lng("timeout-ms", 30000);
        long settleMs = o.lng("settle-ms", 500);
        result.put("topic", topic);
        result.put("group", group);
        result.put("consumer", kind);
        result.put("expect", expect);
        Collector col = newCollector();
        RunningConsumer c = startConsumer(kind, topic, group, col);
        java.io.File stop = new java.io.File(o.str("stop-file", "/nonexistent/stop"));
        boolean reached;
        try {
            reached = await(c, () -> col.distinctOk() >= expect || stop.exists(), timeoutMs, settleMs);
        } finally {
            c.shutdown();
        }
        col.report(result);
        result.put("timed_out", !reached);
        log("consumed %d distinct (expected %d)%s", col.distinctOk(), expect, reached ? "" : " -- TIMED OUT");
        return reached ? EXIT_OK : EXIT_INCOMPLETE;
    }

    // ------------------------------------------------------------------ roundtrip

    private static List<Map<String, Object>> compare(Map<Integer, Spec> specs, String runId,
                                                      List<Map<String, Object>> deliveries, int maxBodyPrint,
                                                      Set<Integer> seen) {
        List<Map<String, Object>> mismatched = new ArrayList<>();
        for (Map<String, Object> d : deliveries) {
            Integer idx = (Integer) d.get("idx");
            if (idx == null || !runId.equals(d.get("run"))) {
                continue;
            }
            seen.add(idx);
            Spec s = specs.get(idx);
            if (s == null) {
                continue;
            }
            Map<String, Object> want = s.describe(maxBodyPrint);
            for (String f : new String[] {"body_sha256", "body_len", "keys", "props"}) {
                Object w = want.get(f);
                Object g = d.get(f);
                if (w == null ? g != null : !w.equals(g)) {
                    Map<String, Object> mm = new LinkedHashMap<>();
                    mm.put("idx", idx);
                    mm.put("field", f);
                    mm.put("sent", w);
                    mm.put("got", g);
                    mismatched.add(mm);
                }
            }
            Object wantTag = want.get("tag");
            if (wantTag == null ? d.get("tags") != null : !wantTag.equals(d.get("tags"))) {
                Map<String, Object> mm = new LinkedHashMap<>();
                mm.put("idx", idx);
                mm.put("field", "tags");
                mm.put("sent", wantTag);
                mm.put("got", d.get("tags"));
                mismatched.add(mm);
            }
        }
        return mismatched;
    }

    private int roundtripScenario(Map<String, Object> result) throws Exception {
        String topic = topic();
        String mode = o.str("mode", "sync");
        String kind = o.str("consumer", "push");
        int count = o.integer("count", 10);
        int start = o.integer("start-index", 0);
        long timeoutMs = o.lng("timeout-ms", 30000);
        long settleMs = o.lng("settle-ms", 500);
        Spec.Plan plan = plan();
        result.put("topic", topic);
        result.put("mode", mode);
        result.put("consumer", kind);
        Collector col = new Collector(T0, runId, o.integer("fail-every", 0), maxBodyPrint);
        RunningConsumer c = startConsumer(kind, topic, group("_c"), col);
        SendOutcome out;
        boolean reached;
        try {
            DefaultMQProducer p = newProducer(new DefaultMQProducer(group("_p"), rpcHook()));
            p.start();
            try {
                out = produce(p, topic, mode, start, count, plan);
            } finally {
                shutdown("producer", p::shutdown);
            }
            int expect = out.sent.size();
            reached = await(c, () -> col.distinctOk() >= expect, timeoutMs, settleMs);
        } finally {
            c.shutdown();
        }
        Map<String, Object> consumed = new LinkedHashMap<>();
        col.report(consumed);
        Set<Integer> seen = new TreeSet<>();
        List<Map<String, Object>> mismatched = compare(out.specs, runId, col.deliveries(), maxBodyPrint, seen);
        List<Integer> lost = new ArrayList<>();
        for (Map<String, Object> s : out.sent) {
            Integer idx = (Integer) s.get("idx");
            if (!seen.contains(idx)) {
                lost.add(idx);
            }
        }
        result.put("sent", out.sent);
        result.put("failed", out.failed);
        result.put("consumed", consumed);
        result.put("lost", lost);
        result.put("duplicates", consumed.get("duplicates"));
        result.put("mismatched", mismatched);
        result.put("timed_out", !reached);
        boolean good = out.failed.isEmpty() && lost.isEmpty() && mismatched.isEmpty()
            && ((List<?>) consumed.get("duplicates")).isEmpty();
        log("roundtrip: sent=%d failed=%d lost=%d dup=%d mismatched=%d", out.sent.size(), out.failed.size(),
            lost.size(), ((List<?>) consumed.get("duplicates")).size(), mismatched.size());
        if (!out.failed.isEmpty()) {
            return EXIT_SEND_FAILED;
        }
        return good ? EXIT_OK : EXIT_INCOMPLETE;
    }

    // ------------------------------------------------------------------ transaction

    private int transactionScenario(Map<String, Object> result) throws Exception {
        String topic = topic();
        int count = o.integer("count", 6);
        int start = o.integer("start-index", 0);
        int unknownEvery = o.integer("unknown-every", 2);
        int rollbackEvery = o.integer("rollback-every", 0);
        String checkResult = o.str("check-result", "commit");
        long timeoutMs = o.lng("timeout-ms", 45000);
        long settleMs = o.lng("settle-ms", 1000);
        boolean consume = o.bool("consume", true);
        Spec.Plan plan = plan();
        result.put("topic", topic);

        Map<Integer, String> local = new ConcurrentHashMap<>();
        Map<Integer, Map<String, Object>> checks = new ConcurrentHashMap<>();
        AtomicInteger checkCalls = new AtomicInteger();
        LocalTransactionState onCheck;
        switch (checkResult) {
            case "commit":
                onCheck = LocalTransactionState.COMMIT_MESSAGE;
                break;
            case "rollback":
                onCheck = LocalTransactionState.ROLLBACK_MESSAGE;
                break;
            case "unknown":
                onCheck = LocalTransactionState.UNKNOW;
                break;
            default:
                throw new IllegalArgumentException("--check-result commit|rollback|unknown");
        }
        Set<Integer> expectCommitted = new TreeSet<>();
        Set<Integer> expectChecked = new TreeSet<>();
        for (int i = start; i < start + count; i++) {
            if (rollbackEvery > 0 && Math.floorMod(i, rollbackEvery) == rollbackEvery - 1) {
                continue;
            }
            if (unknownEvery > 0 && Math.floorMod(i, unknownEvery) == unknownEvery - 1) {
                expectChecked.add(i);
                if (onCheck == LocalTransactionState.COMMIT_MESSAGE) {
                    expectCommitted.add(i);
                }
                continue;
            }
            expectCommitted.add(i);
        }

        Collector col = new Collector(T0, runId, 0, maxBodyPrint);
        RunningConsumer c = consume ? startConsumer(o.str("consumer", "push"), topic, group("_c"), col) : null;
        TransactionMQProducer p = new TransactionMQProducer(group("_tx"), rpcHook());
        newProducer(p);
        p.setTransactionListener(new TransactionListener() {
            @Override
            public LocalTransactionState executeLocalTransaction(Message msg, Object arg) {
                int idx = (Integer) arg;
                LocalTransactionState st;
                if (rollbackEvery > 0 && Math.floorMod(idx, rollbackEvery) == rollbackEvery - 1) {
                    st = LocalTransactionState.ROLLBACK_MESSAGE;
                } else if (unknownEvery > 0 && Math.floorMod(idx, unknownEvery) == unknownEvery - 1) {
                    st = LocalTransactionState.UNKNOW;
                } else {
                    st = LocalTransactionState.COMMIT_MESSAGE;
                }
                local.put(idx, st.name());
                return st;
            }

            @Override
            public LocalTransactionState checkLocalTransaction(MessageExt msg) {
                checkCalls.incrementAndGet();
                String idxs = msg.getUserProperty("idx");
                if (idxs == null || !runId.equals(msg.getUserProperty("run"))) {
                    log("check-back for a message of another run: %s", msg.getMsgId());
                    return LocalTransactionState.ROLLBACK_MESSAGE;
                }
                int idx = Integer.parseInt(idxs);
                checks.compute(idx, (k, rec) -> {
                    if (rec == null) {
                        rec = new LinkedHashMap<>();
                        rec.put("idx", idx);
                        rec.put("msg_id", msg.getMsgId());
                        rec.put("transaction_id", msg.getTransactionId());
                        rec.put("first_check_ms", System.currentTimeMillis() - T0);
                        rec.put("times", 0);
                        rec.put("answer", onCheck.name());
                        rec.put("queue_offset", msg.getQueueOffset());
                        rec.put("commit_log_offset", msg.getCommitLogOffset());
                        rec.put("store_host", msg.getStoreHost() == null ? null : msg.getStoreHost().toString());
                    }
                    rec.put("times", (Integer) rec.get("times") + 1);
                    return rec;
                });
                log("check-back idx=%d msgId=%s txId=%s -> %s", idx, msg.getMsgId(), msg.getTransactionId(), onCheck);
                return onCheck;
            }
        });
        List<Map<String, Object>> sent = new ArrayList<>();
        List<Map<String, Object>> failed = new ArrayList<>();
        boolean reached = false;
        try {
            p.start();
            for (int i = start; i < start + count; i++) {
                Spec s = plan.make(i);
                Message m = s.toMessage(topic);
                Map<String, Object> rec = s.describe(maxBodyPrint);
                try {
                    TransactionSendResult r = p.sendMessageInTransaction(m, i);
                    putResult(rec, r);
                    rec.put("transaction_id", r.getTransactionId());
                    rec.put("local_state", r.getLocalTransactionState() == null ? null
                        : r.getLocalTransactionState().name());
                    sent.add(rec);
                } catch (Exception e) {
                    rec.put("error", errorText(e));
                    failed.add(rec);
                    log("transactional send idx=%d failed: %s", i, e);
                }
            }
            log("sent %d half messages; waiting for check-backs of %s and delivery of %s", sent.size(),
                expectChecked, expectCommitted);
            long end = System.currentTimeMillis() + timeoutMs;
            while (System.currentTimeMillis() < end) {
                boolean checkedAll = checks.keySet().containsAll(expectChecked);
                boolean consumedAll = !consume || idxSet(col.okKeys()).containsAll(expectCommitted);
                if (checkedAll && consumedAll) {
                    reached = true;
                    break;
                }
                if (c != null) {
                    c.pump(100);
                } else {
                    Thread.sleep(100);
                }
            }
            if (c != null && settleMs > 0) {
                c.pump(settleMs);
            }
        } finally {
            if (c != null) {
                c.shutdown();
            }
            shutdown("tx-producer", p::shutdown);
        }
        Set<Integer> consumedIdx = idxSet(col.okKeys());
        List<Integer> missing = new ArrayList<>();
        if (consume) {
            for (Integer i : expectCommitted) {
                if (!consumedIdx.contains(i)) {
                    missing.add(i);
                }
            }
        }
        List<Integer> unexpected = new ArrayList<>();
        for (Integer i : consumedIdx) {
            if (!expectCommitted.contains(i)) {
                unexpected.add(i);
            }
        }
        List<Integer> notChecked = new ArrayList<>();
        for (Integer i : expectChecked) {
            if (!checks.containsKey(i)) {
                notChecked.add(i);
            }
        }
        List<Map<String, Object>> checkList = new ArrayList<>();
        for (Integer i : new TreeSet<>(checks.keySet())) {
            checkList.add(checks.get(i));
        }
        result.put("group", p.getProducerGroup());
        result.put("sent", sent);
        result.put("failed", failed);
        result.put("local_states", new java.util.TreeMap<>(local));
        result.put("checked", checkList);
        result.put("check_calls", checkCalls.get());
        result.put("expect_checked", new ArrayList<>(expectChecked));
        result.put("expect_committed", new ArrayList<>(expectCommitted));
        result.put("not_checked", notChecked);
        result.put("consumed_idx", new ArrayList<>(consumedIdx));
        result.put("missing", missing);
        result.put("unexpected", unexpected);
        if (consume) {
            Map<String, Object> consumed = new LinkedHashMap<>();
            col.report(consumed);
            result.put("consumed", consumed);
        }
        result.put("timed_out", !reached);
        log("transaction: sent=%d checked=%s missing=%s unexpected=%s", sent.size(), checks.keySet(), missing,
            unexpected);
        if (!failed.isEmpty()) {
            return EXIT_SEND_FAILED;
        }
        return reached && missing.isEmpty() && unexpected.isEmpty() && notChecked.isEmpty() ? EXIT_OK
            : EXIT_INCOMPLETE;
    }

    private static Set<Integer> idxSet(Set<String> keys) {
        Set<Integer> out = new TreeSet<>();
        for (String k : keys) {
            int colon = k.lastIndexOf(':');
            if (colon >= 0) {
                try {
                    out.add(Integer.parseInt(k.substring(colon + 1)));
                } catch (NumberFormatException ignored) {
                    // not one of ours
                }
            }
        }
        return out;
    }

    // ------------------------------------------------------------------ queues

    private int queuesScenario(Map<String, Object> result) throws Exception {
        String topic = topic();
        DefaultMQProducer p = newProducer(new DefaultMQProducer(group(""), rpcHook()));
        p.start();
        List<Map<String, Object>> qs = new ArrayList<>();
        try {
            List<MessageQueue> mqs = new ArrayList<>(p.fetchPublishMessageQueues(topic));
            Collections.sort(mqs);
            for (MessageQueue mq : mqs) {
                Map<String, Object> q = new LinkedHashMap<>();
                q.put("topic", mq.getTopic());
                q.put("broker_name", mq.getBrokerName());
                q.put("queue_id", mq.getQueueId());
                qs.add(q);
            }
        } finally {
            shutdown("producer", p::shutdown);
        }
        result.put("topic", topic);
        result.put("queues", qs);
        result.put("brokers", new ArrayList<>(new LinkedHashSet<>(
            Arrays.asList(qs.stream().map(q -> (String) q.get("broker_name")).toArray(String[]::new)))));
        return EXIT_OK;
    }
    // ------------------------------------------------------------------ perf-produce (benchmarks)

    /**
     * Throughput and latency of synchronous sends: --threads T senders share one producer and send
     * --body-size byte messages for --warmup-ms, then measure for --duration-ms. Every send's latency
     * is recorded (microseconds); the result has msg_per_s and p50/p99/p99.9.
     */
    private int perfProduceScenario(Map<String, Object> result) throws Exception {
        String topic = topic();
        int threads = o.integer("threads", 16);
        long warmupMs = o.lng("warmup-ms", 2000);
        long durationMs = o.lng("duration-ms", 10000);
        byte[] body = new byte[o.integer("body-size", 1024)];
        Arrays.fill(body, (byte) 'x');
        DefaultMQProducer p = newProducer(new DefaultMQProducer(group(""), rpcHook()));
        p.start();
        final long begin = System.nanoTime();
        final long measureFrom = begin + warmupMs * 1_000_000L;
        final long measureTo = measureFrom + durationMs * 1_000_000L;
        long[][] lat = new long[threads][];
        int[] counts = new int[threads];
        AtomicInteger failed = new AtomicInteger();
        List<Thread> ts = new ArrayList<>();
        for (int t = 0; t < threads; t++) {
            final int ti = t;
            Thread th = new Thread(() -> {
                long[] mine = new long[1 << 16];
                int n = 0;
                int seq = 0;
                while (true) {
                    long t0 = System.nanoTime();
                    if (t0 >= measureTo) {
                        break;
                    }
                    Message m = new Message(topic, "TagA", "k" + ti + "_" + seq++, body);
                    boolean ok;
                    try {
                        ok = p.send(m).getSendStatus() == SendStatus.SEND_OK;
                    } catch (Exception e) {
                        ok = false;
                    }
                    long t1 = System.nanoTime();
                    if (t0 < measureFrom) {
                        continue;
                    }
                    if (!ok) {
                        failed.incrementAndGet();
                        continue;
                    }
                    if (n == mine.length) {
                        mine = Arrays.copyOf(mine, n * 2);
                    }
                    mine[n++] = (t1 - t0) / 1000;
                }
                lat[ti] = mine;
                counts[ti] = n;
            }, "perf-" + t);
            ts.add(th);
            th.start();
        }
        for (Thread th : ts) {
            th.join();
        }
        shutdown("producer", p::shutdown);
        int total = 0;
        for (int c : counts) {
            total += c;
        }
        long[] all = new long[total];
        int k = 0;
        for (int t = 0; t < threads; t++) {
            System.arraycopy(lat[t], 0, all, k, counts[t]);
            k += counts[t];
        }
        Arrays.sort(all);
        result.put("topic", topic);
        result.put("threads", threads);
        result.put("duration_s", durationMs / 1000.0);
        result.put("sent_count", total);
        result.put("failed_count", failed.get());
        result.put("msg_per_s", total * 1000.0 / durationMs);
        Map<String, Object> pct = new LinkedHashMap<>();
        pct.put("p50", percentile(all, 0.50));
        pct.put("p99", percentile(all, 0.99));
        pct.put("p999", percentile(all, 0.999));
        pct.put("max", total > 0 ? all[total - 1] : 0);
        result.put("lat_us", pct);
        return failed.get() == 0 || o.bool("allow-failures", false) ? EXIT_OK : EXIT_SEND_FAILED;
    }

    private static long percentile(long[] sorted, double q) {
        if (sorted.length == 0) {
            return 0;
        }
        int i = (int) Math.ceil(q * sorted.length) - 1;
        return sorted[Math.max(0, Math.min(sorted.length - 1, i))];
    }
}
