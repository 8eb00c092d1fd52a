import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Collections;
import java.util.List;
import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.consumer.FilterExpression;
import org.apache.rocketmq.client.apis.consumer.FilterExpressionType;
import org.apache.rocketmq.client.apis.consumer.SimpleConsumer;
import org.apache.rocketmq.client.apis.message.Message;
import org.apache.rocketmq.client.apis.message.MessageBuilder;
import org.apache.rocketmq.client.apis.message.MessageView;
import org.apache.rocketmq.client.apis.producer.Producer;
import org.apache.rocketmq.client.apis.producer.SendReceipt;

/**
 * The real RocketMQ 5.x gRPC client against an endpoint (rmqfast's gRPC front in the tests).
 *
 * <pre>
 *   produce ENDPOINT TOPIC PREFIX COUNT [GROUPS]   sends PREFIX-i (message group "g" + i % GROUPS when GROUPS > 0)
 *   consume ENDPOINT TOPIC GROUP PREFIX COUNT SECONDS   SimpleConsumer: receive + ack until COUNT bodies
 *                                                        starting with PREFIX came, or SECONDS passed
 * </pre>
 * One line per event on stdout: "SENT id body", "RECV id group attempt body", "DONE n".
 */
public final class GrpcDriver {
    public static void main(String[] args) throws Exception {
        ClientServiceProvider provider = ClientServiceProvider.loadService();
        ClientConfiguration cc = ClientConfiguration.newBuilder().setEndpoints(args[1]).enableSsl(false)
            .setRequestTimeout(Duration.ofSeconds(10)).build();
        if ("produce".equals(args[0])) {
            produce(provider, cc, args[2], args[3], Integer.parseInt(args[4]), args.length > 5 ? Integer.parseInt(args[5]) : 0);
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
}
