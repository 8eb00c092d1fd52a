/*
 * remoting.h: the few pieces of the RocketMQ Remoting wire format that loadgen.c and
 * nullbroker.c both need.  Header-only so each tool stays one `gcc -O2 x.c` away.
 *
 * A frame (RemotingCommand.encode in apache/rocketmq):
 *
 *     int32 length      = 4 + headerLen + bodyLen   (excludes itself; big-endian)
 *     int32 headerMark  = serializeType << 24 | headerLen   (0 = JSON, 1 = ROCKETMQ)
 *     byte[headerLen]   header
 *     byte[bodyLen]     body
 *
 * Both tools only ever need code, flag and opaque out of a header, so that is all that is
 * parsed here, and without allocating: these tools must never be the bottleneck.
 */
#ifndef RMQFAST_BENCH_REMOTING_H
#define RMQFAST_BENCH_REMOTING_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* RocketMQ's default frame limit (com.rocketmq.remoting.frameMaxLength). */
#define RMQ_MAX_FRAME (16u * 1024u * 1024u)

#define RMQ_FLAG_RESPONSE 1
#define RMQ_FLAG_ONEWAY 2

#define RMQ_SEND_MESSAGE 10
#define RMQ_PULL_MESSAGE 11
#define RMQ_SEND_MESSAGE_V2 310
#define RMQ_SEND_BATCH_MESSAGE 320
#define RMQ_LITE_PULL_MESSAGE 361

static inline uint32_t rd_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline uint16_t rd_be16(const uint8_t *p)
{
    return (uint16_t)(p[0] << 8 | p[1]);
}

static inline void wr_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static inline void wr_be64(uint8_t *p, uint64_t v)
{
    wr_be32(p, (uint32_t)(v >> 32));
    wr_be32(p + 4, (uint32_t)v);
}

/* Copy a string literal and advance: PUT_LIT(p, "abc"). */
#define PUT_LIT(p, lit) (memcpy((p), (lit), sizeof(lit) - 1), (p) += sizeof(lit) - 1)

/* Decimal digits of v at dst; returns the end.  (snprintf is ~10x slower per call.) */
static inline char *put_u64(char *dst, uint64_t v)
{
    char tmp[20];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *dst++ = tmp[--n];
    return dst;
}

static inline char *put_i64(char *dst, int64_t v)
{
    if (v < 0) {
        *dst++ = '-';
        return put_u64(dst, (uint64_t)0 - (uint64_t)v);
    }
    return put_u64(dst, (uint64_t)v);
}

/* Exactly `digits` upper-case hex digits of v (Java's msgId / UNIQ_KEY style). */
static inline char *put_hex(char *dst, uint64_t v, int digits)
{
    static const char hex[] = "0123456789ABCDEF";
    for (int i = digits - 1; i >= 0; i--) {
        dst[i] = hex[v & 15];
        v >>= 4;
    }
    return dst + digits;
}

struct rmq_head {
    int32_t code;
    int32_t flag;
    int32_t opaque;
};

/* Integer after a JSON key: optional spaces and quote (fastjson writes these unquoted, some
 * clients quote them), optional '-', digits.  Missing or malformed gives 0. */
static inline int32_t json_int_at(const uint8_t *p, const uint8_t *end)
{
    while (p < end && (*p == ' ' || *p == '"'))
        p++;
    int neg = 0;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    int64_t v = 0;
    while (p < end && *p >= '0' && *p <= '9' && v < 0x80000000LL)
        v = v * 10 + (*p++ - '0');
    return (int32_t)(neg ? -v : v);
}

/* Last occurrence of key (a literal including its quotes and colon) in h[0:n], or NULL. */
static inline const uint8_t *find_last(const uint8_t *h, size_t n, const char *key, size_t klen)
{
    if (n < klen)
        return NULL;
    for (const uint8_t *p = h + n - klen;; p--) {
        if (*p == (uint8_t)key[0] && memcmp(p, key, klen) == 0)
            return p;
        if (p == h)
            return NULL;
    }
}

#define FIND_LAST(h, n, lit) find_last((h), (n), (lit), sizeof(lit) - 1)

/*
 * code, flag and opaque of a header.  JSON: fastjson writes the getters in alphabetical
 * order, so "code" comes first and "flag" and "opaque" come after "extFields": searching
 * "code" from the front and the other two from the back means an extFields key or value can
 * never be mistaken for them (a quote inside a JSON string is always escaped).  ROCKETMQ
 * binary: fixed offsets (int16 code, int8 language, int16 version, int32 opaque, int32 flag).
 * Returns 0, or -1 for a header too short to hold a code.
 */
static inline int rmq_parse_head(const uint8_t *h, uint32_t hlen, int stype, struct rmq_head *out)
{
    if (stype == 1) {
        if (hlen < 21)
            return -1;
        out->code = (int16_t)rd_be16(h);
        out->opaque = (int32_t)rd_be32(h + 5);
        out->flag = (int32_t)rd_be32(h + 9);
        return 0;
    }
    const uint8_t *end = h + hlen;
    const uint8_t *p = memmem(h, hlen, "\"code\":", 7);
    if (p == NULL)
        return -1;
    out->code = json_int_at(p + 7, end);
    p = FIND_LAST(h, hlen, "\"opaque\":");
    out->opaque = p ? json_int_at(p + 9, end) : 0;
    p = FIND_LAST(h, hlen, "\"flag\":");
    out->flag = p ? json_int_at(p + 7, end) : 0;
    return 0;
}

#endif
