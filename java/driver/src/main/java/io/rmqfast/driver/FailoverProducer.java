package io.rmqfast.driver;

import java.io.File;
import java.io.FileOutputStream;
import java.io.FileDescriptor;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.common.MQVersion;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageQueue;

/**
 * A producer that sends continuously (sync, the client's default retry settings) until a stop file
 * appears, printing one line per send on stdout, flushed at once, for broker-kill tests:
 *
 * <pre>
 * FailoverProducer failover --namesrv H:P --topic T --run RUN --stop-file PATH [--group G] [--interval-ms 0]
 *                  [--max-ms 600000] [--body-size 64] [--props k=v,k2=v2 (user properties of every message)]
 *
 * START  client_version
 * OK     idx  epoch_ms  broker_name  queue_id  msg_id  latency_ms
 * FAIL   idx  epoch_ms  latency_ms  error text (one line)
 * END    sent  failed
 * </pre>
 *
 * Message idx has body "fo|RUN|IDX|" padded with '.' to --body-size, keys "fo-RUN-IDX", user properties idx
 * and run.
 */
public final class FailoverProducer {
    private FailoverProducer() {
    }

    public static void main(String[] args) throws Exception {
        PrintStream out = new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);
        System.setOut(System.err);
        Opts o = new Opts(args);
        String namesrv = o.str("namesrv", null);
        String topic = o.str("topic", "FailoverTopic");
        String run = o.str("run", Long.toHexString(System.nanoTime()));
        File stop = new File(o.str("stop-file", "/nonexistent/stop"));
        long interval = o.lng("interval-ms", 0);
        long maxMs = o.lng("max-ms", 600000);
        int bodySize = o.integer("body-size", 64);
        String props = o.str("props", "");
        DefaultMQProducer p = new DefaultMQProducer(o.str("group", "rmqfast_failover_" + run));
        p.setNamesrvAddr(namesrv);
        p.setInstanceName("fo_" + run + "_" + ProcessHandle.current().pid());
        p.setVipChannelEnabled(false);
        p.start();
        out.println("START " + MQVersion.getVersionDesc(MQVersion.CURRENT_VERSION));
        long t0 = System.currentTimeMillis();
        long sent = 0;
        long failed = 0;
        for (long idx = 0; !stop.exists() && System.currentTimeMillis() - t0 < maxMs; idx++) {
            StringBuilder body = new StringBuilder("fo|" + run + "|" + idx + "|");
            while (body.length() < bodySize) {
                body.append('.');
            }
            Message m = new Message(topic, "TagF", "fo-" + run + "-" + idx, body.toString().getBytes(StandardCharsets.UTF_8));
            m.putUserProperty("idx", String.valueOf(idx));
            m.putUserProperty("run", run);
            for (String kv : props.split(",")) {
                int eq = kv.indexOf('=');
                if (eq > 0) {
                    m.putUserProperty(kv.substring(0, eq), kv.substring(eq + 1));
                }
            }
            long s = System.currentTimeMillis();
            try {
                SendResult r = p.send(m);
                long now = System.currentTimeMillis();
                MessageQueue mq = r.getMessageQueue();
                out.println("OK " + idx + " " + now + " " + (mq == null ? "-" : mq.getBrokerName()) + " "
                    + (mq == null ? -1 : mq.getQueueId()) + " " + r.getMsgId() + " " + (now - s));
                sent++;
            } catch (Exception e) {
                long now = System.currentTimeMillis();
                out.println("FAIL " + idx + " " + now + " " + (now - s) + " " + String.valueOf(e).replace('\n', ' '));
                failed++;
            }
            if (interval > 0) {
                Thread.sleep(interval);
            }
        }
        out.println("END " + sent + " " + failed);
        out.flush();
        p.shutdown();
        Runtime.getRuntime().halt(0);
    }
}
