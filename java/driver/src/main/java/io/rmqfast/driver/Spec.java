package io.rmqfast.driver;

import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.SplittableRandom;

import org.apache.rocketmq.common.message.Message;

/** The deterministic content of message number {@code idx} of one run: body, keys, tag, user properties. */
final class Spec {
    final int idx;
    final byte[] body;
    final String keys;
    final String tag;
    final String shard;
    final Map<String, String> props = new LinkedHashMap<>();

    private Spec(int idx, byte[] body, String keys, String tag, String shard) {
        this.idx = idx;
        this.body = body;
        this.keys = keys;
        this.tag = tag;
        this.shard = shard;
    }

    /** Settings shared by all messages of a run. */
    static final class Plan {
        String runId;
        List<String> tags;
        int shardKeys;
        int bodySize;
        String bodyKind = "repeat";
        boolean unicode;
        Map<String, String> extraProps = new LinkedHashMap<>();

        Spec make(int idx) {
            StringBuilder sb = new StringBuilder();
            sb.append("rmq|").append(runId).append('|').append(idx).append('|');
            if (unicode) {
                sb.append("\u00fc\u20ac\u6f22|");
            }
            byte[] head = sb.toString().getBytes(StandardCharsets.UTF_8);
            byte[] body = head;
            if (bodySize > head.length) {
                body = new byte[bodySize];
                System.arraycopy(head, 0, body, 0, head.length);
                if ("hex".equals(bodyKind)) {
                    SplittableRandom rnd = new SplittableRandom(((long) idx << 20) ^ runId.hashCode());
                    String digits = "0123456789abcdef";
                    for (int i = head.length; i < bodySize; i++) {
                        body[i] = (byte) digits.charAt(rnd.nextInt(16));
                    }
                } else {
                    String pat = "abcdefghijklmnopqrstuvwxyz0123456789";
                    for (int i = head.length; i < bodySize; i++) {
                        body[i] = (byte) pat.charAt((i - head.length) % pat.length());
                    }
                }
            }
            String tag = tags.isEmpty() ? "" : tags.get(Math.floorMod(idx, tags.size()));
            String shard = shardKeys > 0 ? "s" + Math.floorMod(idx, shardKeys) : null;
            Spec s = new Spec(idx, body, "key-" + runId + "-" + idx + " alt-" + idx, tag, shard);
            s.props.put("p1", "v" + idx);
            s.props.put("idx", Integer.toString(idx));
            s.props.put("run", runId);
            if (shard != null) {
                s.props.put("shard", shard);
            }
            if (unicode) {
                s.props.put("u", "\u6f22\u5b57-\u00fc-" + idx);
            }
            s.props.putAll(extraProps);
            return s;
        }
    }

    Message toMessage(String topic) {
        Message m = new Message(topic, tag.isEmpty() ? null : tag, keys, body);
        for (Map.Entry<String, String> e : props.entrySet()) {
            m.putUserProperty(e.getKey(), e.getValue());
        }
        return m;
    }

    /** JSON-ready description (without send result fields). */
    Map<String, Object> describe(int maxBodyPrint) {
        Map<String, Object> r = new LinkedHashMap<>();
        r.put("idx", idx);
        describeBody(r, body, maxBodyPrint);
        r.put("keys", keys);
        r.put("tag", tag.isEmpty() ? null : tag);
        r.put("props", new LinkedHashMap<>(props));
        r.put("shard", shard);
        return r;
    }

    static void describeBody(Map<String, Object> r, byte[] body, int maxBodyPrint) {
        if (body == null) {
            body = new byte[0];
        }
        r.put("body_sha256", sha256(body));
        r.put("body_len", body.length);
        String text = new String(body, StandardCharsets.UTF_8);
        r.put("body", text.length() > maxBodyPrint ? text.substring(0, maxBodyPrint) : text);
    }

    static String sha256(byte[] data) {
        try {
            MessageDigest md = MessageDigest.getInstance("SHA-256");
            byte[] d = md.digest(data);
            StringBuilder sb = new StringBuilder(64);
            for (byte b : d) {
                sb.append(Character.forDigit((b >> 4) & 0xf, 16)).append(Character.forDigit(b & 0xf, 16));
            }
            return sb.toString();
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }
}
