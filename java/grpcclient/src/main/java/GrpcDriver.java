import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Collections;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientConfigurationBuilder;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.StaticSessionCredentialsProvider;
import org.apache.rocketmq.client.apis.consumer.FilterExpression;
import org.apache.rocketmq.client.apis.consumer.ConsumeResult;
import org.apache.rocketmq.client.apis.consumer.FilterExpressionType;
import org.apache.rocketmq.client.apis.consumer.SimpleConsumer;
import org.apache.rocketmq.client.apis.message.Message;
import org.apache.rocketmq.client.apis.message.MessageBuilder;
import org.apache.rocketmq.client.apis.message.MessageView;
import org.apache.rocketmq.client.apis.producer.Producer;
import org.apache.rocketmq.client.apis.producer.SendReceipt;
import org.apache.rocketmq.client.apis.producer.Transaction;
import org.apache.rocketmq.client.apis.producer.TransactionResolution;

/**
 * The real RocketMQ 5.x gRPC client against an endpoint (rmqfast's gRPC front in the tests).
 *
 * <pre>
 *   produce ENDPOINT TOPIC PREFIX COUNT [GROUPS]   sends PREFIX-i (message group "g" + i % GROUPS when GROUPS > 0)
 *   consume ENDPOINT TOPIC GROUP PREFIX COUNT SECONDS   SimpleConsumer: receive + ack until COUNT bodies
 *                                                        starting with PREFIX came, or SECONDS passed
 *   fifo ENDPOINT TOPIC GROUP PREFIX COUNT SECONDS      SimpleConsumer receiving one message at a time; the
 *                                                        first delivery of PREFIX-0 is not acked (its invisible
 *                                                        duration is changed to 2 s), every other one is
 *   pushfifo ENDPOINT TOPIC GROUP PREFIX COUNT SECONDS  PushConsumer (4 threads): the first delivery of PREFIX-0
 *                                                        fails, every other one succeeds; until COUNT bodies
 *                                                        starting with PREFIX succeeded, or SECONDS passed
 *   transaction ENDPOINT TOPIC PREFIX SECONDS           transactional sends: PREFIX-commit (committed),
 *                                                        PREFIX-rollback (rolled back), PREFIX-check (left open;
 *                                                        the checker commits it when the proxy asks); then a
 *                                                        SimpleConsumer of group PREFIX receives until the
 *                                                        committed two came and one more empty receive
 *   throughput ENDPOINT TOPIC GROUP SECONDS INFLIGHT BODY CONSUMERS
 *                                                        the benchmark load (bench/grpc_send.py): a Producer
 *                                                        and CONSUMERS SimpleConsumers are built, "READY" is
 *                                                        printed and a line is read from stdin; then INFLIGHT
 *                                                        async sends of BODY bytes are kept in flight for
 *                                                        SECONDS ("SENT n millis failed"); a line is read again;
 *                                                        then the consumers (one thread each) receive (batches
 *                                                        of 32) and ack (async, at most 256 in flight) until
 *                                                        the n sent messages came, or 120 s passed ("RECV
 *                                                        unique millis-to-the-last deliveries ackfailed")
 * </pre>
 * One line per event on stdout: "SENT id body", "RECV id group attempt body", "CHECK id body", "DONE n".
 * With RMQFAST_GRPC_ACCESS_KEY (and RMQFAST_GRPC_SECRET_KEY) set, the client signs its calls with them.
 */
public final class GrpcDriver {
    public static void main(String[] args) throws Exception {
        ClientServiceProvider provider = ClientServiceProvider.loadService();
        ClientConfigurationBuilder ccb = ClientConfiguration.newBuilder().setEndpoints(args[1]).enableSsl(false)
            .setRequestTimeout(Duration.ofSeconds(10));
        String accessKey = System.getenv("RMQFAST_GRPC_ACCESS_KEY");
        if (accessKey != null && !accessKey.isEmpty()) {
            String secretKey = System.getenv("RMQFAST_GRPC_SECRET_KEY");
            ccb.setCredentialProvider(new StaticSessionCredentialsProvider(accessKey, secretKey == null ? "" : secretKey));
        }
        ClientConfiguration cc = ccb.build();
        if ("throughput".equals(args[0])) {
            throughput(provider, cc, args[2], args[3], Integer.parseInt(args[4]), Integer.parseInt(args[5]),
                Integer.parseInt(args[6]), Integer.parseInt(args[7]));
        } else if ("produce".equals(args[0])) {
            produce(provider, cc, args[2], args[3], Integer.parseInt(args[4]), args.length > 5 ? Integer.parseInt(args[5]) : 0);
        } else if ("transaction".equals(args[0])) {
            transaction(provider, cc, args[2], args[3], Integer.parseInt(args[4]));
        } else if ("pushfifo".equals(args[0])) {
            pushFifo(provider, cc, args[2], args[3], args[4], Integer.parseInt(args[5]), Integer.parseInt(args[6]));
        } else if ("fifo".equals(args[0])) {
            fifo(provider, cc, args[2], args[3], args[4], Integer.parseInt(args[5]), Integer.parseInt(args[6]));
        } else {
            consume(provider, cc, args[2], args[3], args[4], Integer.parseInt(args[5]), Integer.parseInt(args[6]));
        }
        System.out.flush();
        System.exit(0);
    }

    private static void produce(ClientServiceProvider provider, ClientConfiguration cc, String topic, String prefix,
                                int count, int groups) throws Exception {
        try (Producer producer = provider.newProducerBuilder().setClientConfiguration(cc).setTopics(topic).build()) {
            for (int i = 0; i < count; i++) {
                String body = prefix + "-" + i;
                MessageBuilder b = provider.newMessageBuilder().setTopic(topic).setTag("jt").setKeys("k" + i)
                    .setBody(body.getBytes(StandardCharsets.UTF_8)).addProperty("driver", "java");
                if (groups > 0) {
                    b.setMessageGroup("g" + (i % groups));
                }
                SendReceipt r = producer.send(b.build());
                System.out.println("SENT " + r.getMessageId() + " " + body);
            }
        }
        System.out.println("DONE " + count);
    }

    private static String body(MessageView v) {
        ByteBuffer buf = v.getBody();
        byte[] data = new byte[buf.remaining()];
        buf.get(data);
        return new String(data, StandardCharsets.UTF_8);
    }

    private static void transaction(ClientServiceProvider provider, ClientConfiguration cc, String topic, String prefix,
                                    int seconds) throws Exception {
        CountDownLatch checked = new CountDownLatch(1);
        FilterExpression all = new FilterExpression("*", FilterExpressionType.TAG);
        Set<String> got = new HashSet<>();
        long deadline = System.currentTimeMillis() + seconds * 1000L;
        try (SimpleConsumer consumer = provider.newSimpleConsumerBuilder().setClientConfiguration(cc)
            .setConsumerGroup(prefix).setAwaitDuration(Duration.ofSeconds(2))
            .setSubscriptionExpressions(Collections.singletonMap(topic, all)).build();
             Producer producer = provider.newProducerBuilder().setClientConfiguration(cc).setTopics(topic)
                 .setTransactionChecker(v -> {
                     String b = body(v);
                     System.out.println("CHECK " + v.getMessageId() + " " + b);
                     checked.countDown();
                     return b.endsWith("-check") ? TransactionResolution.COMMIT : TransactionResolution.ROLLBACK;
                 }).build()) {
            for (String kind : new String[] {"commit", "rollback", "check"}) {
                Transaction tx = producer.beginTransaction();
                String b = prefix + "-" + kind;
                SendReceipt r = producer.send(provider.newMessageBuilder().setTopic(topic).setTag("tx")
                    .setBody(b.getBytes(StandardCharsets.UTF_8)).build(), tx);
                System.out.println("SENT " + r.getMessageId() + " " + b);
                if ("commit".equals(kind)) {
                    tx.commit();
                } else if ("rollback".equals(kind)) {
                    tx.rollback();
                }
            }
            if (!checked.await(Math.max(1, deadline - System.currentTimeMillis()), TimeUnit.MILLISECONDS)) {
                System.out.println("NO CHECK");
            }
            boolean lastEmpty = false;
            while (System.currentTimeMillis() < deadline && !(got.size() >= 2 && lastEmpty)) {
                List<MessageView> views = consumer.receive(16, Duration.ofSeconds(30));
                lastEmpty = views.isEmpty();
                for (MessageView v : views) {
                    consumer.ack(v);
                    String b = body(v);
                    if (b.startsWith(prefix)) {
                        got.add(b);
                        System.out.println("RECV " + v.getMessageId() + " - " + v.getDeliveryAttempt() + " " + b);
                    }
                }
            }
        }
        System.out.println("DONE " + got.size());
    }

    private static void fifo(ClientServiceProvider provider, ClientConfiguration cc, String topic, String group,
                             String prefix, int count, int seconds) throws Exception {
        FilterExpression all = new FilterExpression("*", FilterExpressionType.TAG);
        Set<String> acked = new HashSet<>();
        boolean held = false;
        long deadline = System.currentTimeMillis() + seconds * 1000L;
        try (SimpleConsumer consumer = provider.newSimpleConsumerBuilder().setClientConfiguration(cc)
            .setConsumerGroup(group).setAwaitDuration(Duration.ofSeconds(2))
            .setSubscriptionExpressions(Collections.singletonMap(topic, all)).build()) {
            while (acked.size() < count && System.currentTimeMillis() < deadline) {
                for (MessageView v : consumer.receive(1, Duration.ofSeconds(30))) {
                    String b = body(v);
                    if (!b.startsWith(prefix)) {
                        consumer.ack(v);
                        continue;
                    }
                    System.out.println("RECV " + v.getMessageId() + " " + v.getMessageGroup().orElse("-") + " "
                        + v.getDeliveryAttempt() + " " + b);
                    if (!held && b.equals(prefix + "-0")) {
                        held = true;
                        consumer.changeInvisibleDuration(v, Duration.ofSeconds(2));
                    } else {
                        consumer.ack(v);
                        acked.add(b);
                    }
                }
            }
        }
        System.out.println("DONE " + acked.size());
    }

    private static void pushFifo(ClientServiceProvider provider, ClientConfiguration cc, String topic, String group,
                                 String prefix, int count, int seconds) throws Exception {
        FilterExpression all = new FilterExpression("*", FilterExpressionType.TAG);
        Set<String> ok = java.util.concurrent.ConcurrentHashMap.newKeySet();
        CountDownLatch done = new CountDownLatch(count);
        java.util.concurrent.atomic.AtomicBoolean failed = new java.util.concurrent.atomic.AtomicBoolean();
        // not closed: close() waits for the receives in flight (a long poll of up to 30 s); the JVM exits
        provider.newPushConsumerBuilder().setClientConfiguration(cc)
            .setConsumerGroup(group).setConsumptionThreadCount(4)
            .setSubscriptionExpressions(Collections.singletonMap(topic, all))
            .setMessageListener(v -> {
                String b = body(v);
                if (!b.startsWith(prefix)) {
                    return ConsumeResult.SUCCESS;
                }
                synchronized (GrpcDriver.class) {
                    System.out.println("RECV " + v.getMessageId() + " " + v.getMessageGroup().orElse("-") + " "
                        + v.getDeliveryAttempt() + " " + b);
                }
                if (b.equals(prefix + "-0") && failed.compareAndSet(false, true)) {
                    return ConsumeResult.FAILURE;
                }
                if (ok.add(b)) {
                    done.countDown();
                }
                return ConsumeResult.SUCCESS;
            }).build();
        done.await(seconds, TimeUnit.SECONDS);
        System.out.println("DONE " + ok.size());
    }

    private static void consume(ClientServiceProvider provider, ClientConfiguration cc, String topic, String group,
                                String prefix, int count, int seconds) throws Exception {
        FilterExpression all = new FilterExpression("*", FilterExpressionType.TAG);
        int got = 0;
        long deadline = System.currentTimeMillis() + seconds * 1000L;
        try (SimpleConsumer consumer = provider.newSimpleConsumerBuilder().setClientConfiguration(cc)
            .setConsumerGroup(group).setAwaitDuration(Duration.ofSeconds(5))
            .setSubscriptionExpressions(Collections.singletonMap(topic, all)).build()) {
            while (got < count && System.currentTimeMillis() < deadline) {
                List<MessageView> views = consumer.receive(16, Duration.ofSeconds(30));
                for (MessageView v : views) {
                    ByteBuffer buf = v.getBody();
                    byte[] data = new byte[buf.remaining()];
                    buf.get(data);
                    String body = new String(data, StandardCharsets.UTF_8);
                    consumer.ack(v);
                    if (body.startsWith(prefix)) {
                        got++;
                        System.out.println("RECV " + v.getMessageId() + " " + v.getMessageGroup().orElse("-") + " "
                            + v.getDeliveryAttempt() + " " + body);
                    }
                }
            }
        }
        System.out.println("DONE " + got);
    }

    private static void throughput(ClientServiceProvider provider, ClientConfiguration cc, String topic, String group,
                                   int seconds, int inflight, int size, int consumers) throws Exception {
        FilterExpression all = new FilterExpression("*", FilterExpressionType.TAG);
        java.io.BufferedReader in = new java.io.BufferedReader(new java.io.InputStreamReader(System.in));
        byte[] payload = new byte[size];
        java.util.Arrays.fill(payload, (byte) 'x');
        java.util.List<SimpleConsumer> cs = new java.util.ArrayList<>();
        try (Producer producer = provider.newProducerBuilder().setClientConfiguration(cc).setTopics(topic).build()) {
            for (int i = 0; i < consumers; i++) {
                cs.add(provider.newSimpleConsumerBuilder().setClientConfiguration(cc).setConsumerGroup(group)
                    .setAwaitDuration(Duration.ofSeconds(2))
                    .setSubscriptionExpressions(Collections.singletonMap(topic, all)).build());
            }
            System.out.println("READY");
            System.out.flush();
            in.readLine();
            java.util.concurrent.Semaphore window = new java.util.concurrent.Semaphore(inflight);
            java.util.concurrent.atomic.AtomicLong sent = new java.util.concurrent.atomic.AtomicLong();
            java.util.concurrent.atomic.AtomicLong failed = new java.util.concurrent.atomic.AtomicLong();
            long t0 = System.nanoTime();
            long stop = t0 + seconds * 1_000_000_000L;
            while (System.nanoTime() < stop) {
                window.acquire();
                Message m = provider.newMessageBuilder().setTopic(topic).setTag("b").setBody(payload).build();
                producer.sendAsync(m).whenComplete((r, e) -> {
                    (e == null ? sent : failed).incrementAndGet();
                    window.release();
                });
            }
            window.acquire(inflight);
            long sendMillis = (System.nanoTime() - t0) / 1_000_000;
            long n = sent.get();
            System.out.println("SENT " + n + " " + sendMillis + " " + failed.get());
            System.out.flush();
            in.readLine();
            Set<String> got = java.util.concurrent.ConcurrentHashMap.newKeySet();
            java.util.concurrent.atomic.AtomicLong deliveries = new java.util.concurrent.atomic.AtomicLong();
            java.util.concurrent.atomic.AtomicLong ackFailed = new java.util.concurrent.atomic.AtomicLong();
            java.util.concurrent.Semaphore acks = new java.util.concurrent.Semaphore(256);
            long deadline = System.nanoTime() + 120_000_000_000L;
            long r0 = System.nanoTime();
            java.util.concurrent.atomic.AtomicLong lastNew = new java.util.concurrent.atomic.AtomicLong(r0);
            List<Thread> threads = new java.util.ArrayList<>();
            for (SimpleConsumer c : cs) {
                Thread t = new Thread(() -> {
                    while (got.size() < n && System.nanoTime() < deadline) {
                        List<MessageView> views;
                        try {
                            views = c.receive(32, Duration.ofSeconds(30));
                        } catch (Exception e) {
                            continue;
                        }
                        for (MessageView v : views) {
                            deliveries.incrementAndGet();
                            if (got.add(v.getMessageId().toString())) {
                                lastNew.set(System.nanoTime());
                            }
                            acks.acquireUninterruptibly();
                            c.ackAsync(v).whenComplete((x, e) -> {
                                if (e != null) {
                                    ackFailed.incrementAndGet();
                                }
                                acks.release();
                            });
                        }
                    }
                });
                t.start();
                threads.add(t);
            }
            for (Thread t : threads) {
                t.join();
            }
            acks.acquireUninterruptibly(256);
            long recvMillis = (lastNew.get() - r0) / 1_000_000;  // not the consumers' last (empty) long polls
            System.out.println("RECV " + got.size() + " " + recvMillis + " " + deliveries.get() + " " + ackFailed.get());
            System.out.flush();
            for (SimpleConsumer c : cs) {
                c.close();
            }
        }
        System.out.println("DONE");
    }
}
