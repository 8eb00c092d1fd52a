/*
 * loadgen.c: RocketMQ Remoting load generator of the rmqfast benchmark.
 *
 * Sends SEND_MESSAGE_V2 (310) frames shaped like the Java client's (JSON header, extFields
 * a..n as SendMessageRequestHeaderV2 writes them, properties with KEYS/UNIQ_KEY/WAIT/TAGS in
 * field "i", a fresh UNIQ_KEY and bornTimestamp per message) and, optionally, PULL_MESSAGE
 * (11) frames, over many connections, and times every request by its opaque.
 *
 * Two modes:
 *   closed loop (--rate 0): every connection keeps --inflight requests outstanding; each
 *       answer is replaced at once.  Measures throughput.
 *   open loop (--rate R): R requests per second in total, on a fixed schedule, whatever the
 *       target does.  Latency counts from the *scheduled* send time, so a stalled target
 *       cannot hide its queueing delay (no coordinated omission).  The schedule advances on
 *       a --tick-us timerfd, so every target also pays up to one tick (50 us) of batching.
 *
 * Why it is never the bottleneck: one epoll loop; requests are a template memcpy plus a
 * few patched digits; answers are matched through a per-connection slot table indexed by
 * opaque (no search, no allocation); all the requests a connection gets in one loop
 * iteration leave with one send(); one clock read per recv.  On a spare core it drives
 * several hundred thousand requests per second against nullbroker.
 *
 * Output: one JSON object on stdout (throughput, latency percentiles in microseconds from a
 * log-linear histogram with < 0.8 % bucket error, errors, own CPU time in the window).  Exit 0, or 2 when
 * it cannot connect or is misused.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "remoting.h"

#define MAX_CONNS 4096
#define IN_CAP (256 * 1024)
/* Open loop: a connection with more unsent bytes than this skips its turn (counted). */
#define OUT_BACKLOG_MAX (8u * 1024u * 1024u)
/* Open loop: outstanding requests per connection before the oldest is declared lost. */
#define OPEN_SLOTS 65536

/* ---- options ------------------------------------------------------------------------- */
static const char *opt_host = "127.0.0.1";
static int opt_port;
static int opt_conns = 16;
static int opt_inflight = 32;
static double opt_rate;      /* requests/s in total; 0 = closed loop */
static double opt_duration = 5.0;
static double opt_warmup = 1.0;
static int opt_body = 1024;
static int opt_topics = 1;
static int opt_pull_pct;     /* share of requests that are pulls, 0..100 */
static int opt_tick_us = 50;
static const char *opt_access_key; /* --access-key: AccessKey + a Signature-sized value in every header */
static long long opt_deliver_ms;   /* --deliver-ms: TIMER_DELIVER_MS (epoch ms) in every send's properties */

/* ---- latency histogram ----------------------------------------------------------------- */
/* Values in ns.  Exact below 256; above, 128 buckets per power of two. */
#define SUB_BITS 7
#define SUB (1u << SUB_BITS)
#define NBUCKETS ((64 - SUB_BITS) * SUB + SUB)
static uint64_t hist[NBUCKETS];
static uint64_t hist_n, lat_min = UINT64_MAX, lat_max;
static double lat_sum;

static inline unsigned bucket_of(uint64_t v)
{
    if (v < 2 * SUB)
        return (unsigned)v;
    unsigned shift = (unsigned)(63 - __builtin_clzll(v)) - SUB_BITS;
    return (shift + 1) * SUB + (unsigned)(v >> shift) - SUB;
}

static double bucket_mid(unsigned idx)
{
    if (idx < 2 * SUB)
        return idx;
    unsigned shift = idx / SUB - 1;
    uint64_t low = (uint64_t)(idx % SUB + SUB) << shift;
    return (double)low + (double)((uint64_t)1 << shift) / 2.0;
}

static inline void record(uint64_t ns)
{
    hist[bucket_of(ns)]++;
    hist_n++;
    lat_sum += (double)ns;
    if (ns < lat_min)
        lat_min = ns;
    if (ns > lat_max)
        lat_max = ns;
}

static double percentile_us(double q)
{
    if (hist_n == 0)
        return 0;
    uint64_t want = (uint64_t)ceil(q * (double)hist_n), seen = 0;
    if (want == 0)
        want = 1;
    for (unsigned i = 0; i < NBUCKETS; i++) {
        seen += hist[i];
        if (seen >= want) {
            double v = bucket_mid(i);
            if (v > (double)lat_max)
                v = (double)lat_max; /* the top bucket's midpoint can overshoot */
            return v / 1000.0;
        }
    }
    return (double)lat_max / 1000.0;
}

/* ---- request templates ----------------------------------------------------------------- */
/* A header is `pre` + opaque digits + `post`.  The opaque is the only field whose width
 * varies; the per-message fields in `pre` have fixed width and are patched in place. */
struct tmpl {
    char pre[1024];
    size_t pre_len;
    const char *post;
    size_t post_len;
    size_t off_qid, off_born, off_keys, off_uniq; /* 0 = not in this template */
    int body;                                     /* body bytes after the header */
};

static const char POST[] = ",\"serializeTypeCurrentRPC\":\"JSON\",\"version\":435}";
static struct tmpl *send_t, *pull_t;
static uint8_t *body_bytes;
static char uniq_prefix[20]; /* ip + pid + "classloader" hash, as MessageClientIDSetter */

static size_t append(char *dst, size_t at, const char *s);

/* ,"AccessKey":"AK","Signature":"<28 Base64 chars>" as AclClientRPCHook adds them (the null
 * broker checks no signature; the size is a real one's: Base64 of a 20-byte HmacSHA1). */
static size_t append_acl(char *d, size_t n)
{
    if (opt_access_key == NULL)
        return n;
    n = append(d, n, ",\"AccessKey\":\"");
    n = append(d, n, opt_access_key);
    return append(d, n, "\",\"Signature\":\"c2lnbmF0dXJlLW9mLTIwLWJ5dGU=\"");
}

static size_t append(char *dst, size_t at, const char *s)
{
    size_t n = strlen(s);
    memcpy(dst + at, s, n);
    return at + n;
}

static void topic_name(char *out, size_t cap, int i)
{
    if (opt_topics == 1)
        snprintf(out, cap, "BenchTopic");
    else
        snprintf(out, cap, "BenchTopic_%d", i);
}

/* What fastjson 1.2.83 writes for a Java 5.x SEND_MESSAGE_V2: getters in alphabetical order,
 * ext keys a..n (l, maxReconsumeTimes, is null for non-retry topics and omitted), the
 * \u0001/\u0002 property separators escaped. */
static void build_send(struct tmpl *t, int topic)
{
    char name[64], *d = t->pre;
    size_t n = 0;
    topic_name(name, sizeof name, topic);
    n = append(d, n, "{\"code\":310,\"extFields\":{\"a\":\"PG_bench\",\"b\":\"");
    n = append(d, n, name);
    n = append(d, n, "\",\"c\":\"TBW102\",\"d\":\"4\",\"e\":\"");
    t->off_qid = n;
    n = append(d, n, "0\",\"f\":\"0\",\"g\":\"");
    t->off_born = n;
    n = append(d, n, "0000000000000\",\"h\":\"0\",\"i\":\"KEYS\\u0001k");
    t->off_keys = n;
    n = append(d, n, "00000000\\u0002UNIQ_KEY\\u0001");
    t->off_uniq = n;
    n = append(d, n, "00000000000000000000000000000000\\u0002WAIT\\u0001true\\u0002TAGS\\u0001TagA\\u0002");
    if (opt_deliver_ms > 0) { /* a timer message, as Message.setDeliverTimeMs writes it */
        char deliver[64];
        snprintf(deliver, sizeof deliver, "TIMER_DELIVER_MS\\u0001%lld\\u0002", opt_deliver_ms);
        n = append(d, n, deliver);
    }
    n = append(d, n, "\",\"j\":\"0\",\"k\":\"false\",\"m\":\"false\",\"n\":\"broker-a\"");
    n = append_acl(d, n);
    n = append(d, n, "},\"flag\":0,\"language\":\"JAVA\",\"opaque\":");
    t->pre_len = n;
    t->post = POST;
    t->post_len = sizeof(POST) - 1;
    t->body = opt_body;
}

/* A push consumer's PULL_MESSAGE (PullMessageRequestHeader), suspended pull with subscription. */
static void build_pull(struct tmpl *t, int topic)
{
    char name[64], *d = t->pre;
    size_t n = 0;
    topic_name(name, sizeof name, topic);
    n = append(d, n, "{\"code\":11,\"extFields\":{\"consumerGroup\":\"CG_bench\",\"topic\":\"");
    n = append(d, n, name);
    n = append(d, n, "\",\"queueId\":\"");
    t->off_qid = n;
    n = append(d, n, "0\",\"queueOffset\":\"0\",\"maxMsgNums\":\"32\",\"sysFlag\":\"6\",\"commitOffset\":\"0\","
                     "\"suspendTimeoutMillis\":\"15000\",\"subscription\":\"*\",\"subVersion\":\"0\","
                     "\"expressionType\":\"TAG\"");
    n = append_acl(d, n);
    n = append(d, n, "},\"flag\":0,\"language\":\"JAVA\",\"opaque\":");
    t->pre_len = n;
    t->off_born = t->off_keys = t->off_uniq = 0;
    t->post = POST;
    t->post_len = sizeof(POST) - 1;
    t->body = 0;
}

/* ---- connections ------------------------------------------------------------------------- */
struct slot {
    uint64_t t_ns; /* when the request was (scheduled to be) sent */
    int32_t opaque;
    int32_t used;
};

struct conn {
    int fd, dead, want_out, dirty;
    uint8_t *in;
    size_t in_len, in_cap;
    uint8_t *out;
    size_t out_len, out_off, out_cap;
    int32_t next_opaque;
    uint32_t outstanding;
    struct slot *slots;
    uint32_t mask;
};

static struct conn *conns;
static int ep;

/* ---- counters ---------------------------------------------------------------------------- */
static uint64_t seq;              /* requests built so far (drives topic, queue, keys) */
static unsigned pull_acc;         /* Bresenham accumulator spreading pulls evenly */
static uint64_t born_ms;          /* wall clock, refreshed once per loop iteration */
static uint64_t t_measure, t_end; /* monotonic ns: start and end of the measured window */
static uint64_t sent_w, resp_w, bytes_out_w, bytes_in_w, pulls_w, skipped_w;
static uint64_t err_closed, err_protocol, err_unmatched, err_bad_code, err_lost, server_requests;
static uint64_t codes[8][2]; /* (code, count) of the first distinct response codes */
static int ncodes;

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what)
{
    printf("{\"tool\":\"loadgen\",\"error\":\"%s: %s\"}\n", what, strerror(errno));
    exit(2);
}

static void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n);
    if (p == NULL)
        die("realloc");
    return p;
}

static void count_code(int32_t code)
{
    for (int i = 0; i < ncodes; i++)
        if (codes[i][0] == (uint64_t)(uint32_t)code) {
            codes[i][1]++;
            return;
        }
    if (ncodes < 8) {
        codes[ncodes][0] = (uint64_t)(uint32_t)code;
        codes[ncodes++][1] = 1;
    }
}

static void conn_fail(struct conn *c)
{
    if (c->dead)
        return;
    c->dead = 1;
    err_closed++;
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
}

/* Append one request to the connection's output, timed from t_ns. */
static void queue_request(struct conn *c, uint64_t t_ns)
{
    int is_pull = 0;
    if (opt_pull_pct) {
        pull_acc += (unsigned)opt_pull_pct;
        if (pull_acc >= 100) {
            pull_acc -= 100;
            is_pull = 1;
        }
    }
    uint64_t s = seq++;
    const struct tmpl *t = is_pull ? &pull_t[s % (uint64_t)opt_topics] : &send_t[s % (uint64_t)opt_topics];
    size_t need = 8 + t->pre_len + 12 + t->post_len + (size_t)t->body;
    if (c->out_cap - c->out_len < need) {
        if (c->out_off) { /* reclaim the sent part first */
            memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
            c->out_len -= c->out_off;
            c->out_off = 0;
        }
        if (c->out_cap - c->out_len < need) {
            c->out_cap = 2 * c->out_cap + need;
            c->out = xrealloc(c->out, c->out_cap);
        }
    }
    uint8_t *f = c->out + c->out_len;
    char *h = (char *)f + 8;
    memcpy(h, t->pre, t->pre_len);
    h[t->off_qid] = (char)('0' + (s & 3));
    if (t->off_born) {
        put_u64(h + t->off_born, born_ms); /* 13 digits until 2286 */
        put_hex(h + t->off_keys, s, 8);
        memcpy(h + t->off_uniq, uniq_prefix, 20);
        put_hex(h + t->off_uniq + 20, s, 12);
    }
    int32_t opaque = c->next_opaque;
    c->next_opaque = opaque == INT32_MAX ? 1 : opaque + 1;
    char *p = put_i64(h + t->pre_len, opaque);
    memcpy(p, t->post, t->post_len);
    p += t->post_len;
    size_t hlen = (size_t)(p - h);
    memcpy(p, body_bytes, (size_t)t->body);
    wr_be32(f, (uint32_t)(4 + hlen + (size_t)t->body));
    wr_be32(f + 4, (uint32_t)hlen);
    size_t flen = 8 + hlen + (size_t)t->body;
    c->out_len += flen;

    struct slot *sl = &c->slots[(uint32_t)opaque & c->mask];
    if (sl->used) { /* its answer never came within the slot window */
        err_lost++;
        c->outstanding--;
    }
    sl->used = 1;
    sl->opaque = opaque;
    sl->t_ns = t_ns;
    c->outstanding++;
    if (t_ns >= t_measure) {
        sent_w++;
        bytes_out_w += flen;
        pulls_w += (uint64_t)is_pull;
    }
    c->dirty = 1;
}

static void flush_out(struct conn *c)
{
    c->dirty = 0;
    while (!c->dead && c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (!c->want_out) {
                    c->want_out = 1;
                    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
                    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
                }
                return;
            }
            conn_fail(c);
            return;
        }
        c->out_off += (size_t)n;
    }
    c->out_off = c->out_len = 0;
    if (c->want_out) {
        c->want_out = 0;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
    }
}

static void on_readable(struct conn *c, int closed_loop)
{
    if (c->in_cap - c->in_len == 0) { /* only when one frame is larger than the buffer */
        c->in_cap *= 2;
        c->in = xrealloc(c->in, c->in_cap);
    }
    ssize_t n = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
    if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        conn_fail(c);
        return;
    }
    uint64_t now = now_ns();
    int in_window = now >= t_measure;
    c->in_len += (size_t)n;
    size_t pos = 0;
    while (c->in_len - pos >= 8) {
        uint8_t *f = c->in + pos;
        uint32_t len = rd_be32(f);
        if (len < 4 || len > RMQ_MAX_FRAME - 4) {
            err_protocol++;
            conn_fail(c);
            return;
        }
        if (c->in_len - pos < 4 + (size_t)len) {
            if (4 + (size_t)len > c->in_cap) {
                c->in_cap = 4 + (size_t)len;
                c->in = xrealloc(c->in, c->in_cap);
            }
            break;
        }
        uint32_t mark = rd_be32(f + 4);
        uint32_t hlen = mark & 0xFFFFFF;
        struct rmq_head rh;
        if (hlen > len - 4 || rmq_parse_head(f + 8, hlen, (int)(mark >> 24), &rh) != 0) {
            err_protocol++;
            conn_fail(c);
            return;
        }
        pos += 4 + (size_t)len;
        if (!(rh.flag & RMQ_FLAG_RESPONSE)) {
            server_requests++; /* the "broker" asked us something; not part of the load */
            continue;
        }
        struct slot *sl = &c->slots[(uint32_t)rh.opaque & c->mask];
        if (!sl->used || sl->opaque != rh.opaque) {
            err_unmatched++;
            continue;
        }
        sl->used = 0;
        c->outstanding--;
        if (in_window) {
            record(now - sl->t_ns);
            resp_w++;
            bytes_in_w += 4 + (uint64_t)len;
            count_code(rh.code);
            if (rh.code != 0)
                err_bad_code++;
        }
    }
    if (pos) {
        memmove(c->in, c->in + pos, c->in_len - pos);
        c->in_len -= pos;
    }
    if (closed_loop && now < t_end) {
        uint64_t t = now_ns();
        while (c->outstanding < (uint32_t)opt_inflight)
            queue_request(c, t);
    }
    if (c->dirty)
        flush_out(c);
}

static void connect_all(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)opt_port)};
    if (inet_pton(AF_INET, opt_host, &a.sin_addr) != 1) {
        errno = EINVAL;
        die("--host");
    }
    uint32_t nslots = OPEN_SLOTS;
    if (opt_rate == 0) { /* closed loop: at most `inflight` outstanding; 4x leaves slack */
        nslots = 64;
        while (nslots < 4u * (uint32_t)opt_inflight)
            nslots <<= 1;
    }
    for (int i = 0; i < opt_conns; i++) {
        struct conn *c = &conns[i];
        c->fd = socket(AF_INET, SOCK_STREAM, 0);
        if (c->fd < 0)
            die("socket");
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (connect(c->fd, (struct sockaddr *)&a, sizeof a) < 0)
            die("connect");
        if (fcntl(c->fd, F_SETFL, O_NONBLOCK) < 0)
            die("fcntl");
        c->in_cap = IN_CAP;
        c->in = xrealloc(NULL, IN_CAP);
        c->out_cap = 64 * 1024;
        c->out = xrealloc(NULL, c->out_cap);
        c->next_opaque = 1;
        c->mask = nslots - 1;
        c->slots = calloc(nslots, sizeof(struct slot));
        if (c->slots == NULL)
            die("calloc");
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev) < 0)
            die("epoll_ctl");
    }
}

/* Open loop: issue every request whose scheduled time has come, round-robin over the
 * connections, each timed from its schedule (t0 + j / rate), then one send per connection. */
static uint64_t scheduled;

static void open_loop_tick(uint64_t t0, uint64_t now)
{
    if (now >= t_end)
        return;
    uint64_t due = (uint64_t)((double)(now - t0) * opt_rate / 1e9);
    for (; scheduled < due; scheduled++) {
        uint64_t t_j = t0 + (uint64_t)((double)scheduled * 1e9 / opt_rate);
        struct conn *c = &conns[scheduled % (uint64_t)opt_conns];
        if (c->dead || c->out_len - c->out_off > OUT_BACKLOG_MAX) {
            if (t_j >= t_measure)
                skipped_w++;
            continue;
        }
        queue_request(c, t_j);
    }
    for (int i = 0; i < opt_conns; i++)
        if (conns[i].dirty)
            flush_out(&conns[i]);
}

static double num_arg(const char *name, const char *v, double lo, double hi)
{
    char *end;
    double x = strtod(v, &end);
    if (*v == '\0' || *end != '\0' || !(x >= lo && x <= hi)) {
        fprintf(stderr, "loadgen: %s %s is not allowed; expected a number from %g to %g\n", name, v, lo, hi);
        exit(2);
    }
    return x;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: loadgen --port P [--host 127.0.0.1] [--conns 16] [--inflight 32] [--rate 0]\n"
            "               [--duration 5] [--warmup 1] [--body 1024] [--topics 1] [--pull-pct 0]\n"
            "               [--tick-us 50] [--access-key AK] [--deliver-ms EPOCH_MS]\n"
            "  --rate 0 is the closed loop (--inflight per connection); --rate R > 0 sends R\n"
            "  requests/s in total on a fixed schedule (open loop; --inflight is ignored).\n");
    exit(2);
}

static void parse_args(int argc, char **argv)
{
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL)
            usage();
        if (!strcmp(a, "--host"))
            opt_host = v;
        else if (!strcmp(a, "--port"))
            opt_port = (int)num_arg(a, v, 1, 65535);
        else if (!strcmp(a, "--conns"))
            opt_conns = (int)num_arg(a, v, 1, MAX_CONNS);
        else if (!strcmp(a, "--inflight"))
            opt_inflight = (int)num_arg(a, v, 1, 65536);
        else if (!strcmp(a, "--rate"))
            opt_rate = num_arg(a, v, 0, 1e8);
        else if (!strcmp(a, "--duration"))
            opt_duration = num_arg(a, v, 0.01, 86400);
        else if (!strcmp(a, "--warmup"))
            opt_warmup = num_arg(a, v, 0, 86400);
        else if (!strcmp(a, "--body"))
            opt_body = (int)num_arg(a, v, 0, 4 * 1024 * 1024);
        else if (!strcmp(a, "--topics"))
            opt_topics = (int)num_arg(a, v, 1, 100000);
        else if (!strcmp(a, "--pull-pct"))
            opt_pull_pct = (int)num_arg(a, v, 0, 100);
        else if (!strcmp(a, "--tick-us"))
            opt_tick_us = (int)num_arg(a, v, 1, 1000000);
        else if (!strcmp(a, "--access-key") && strlen(v) < 200)
            opt_access_key = v;
        else if (!strcmp(a, "--deliver-ms"))
            opt_deliver_ms = (long long)num_arg(a, v, 1, 253402300799999.0);
        else
            usage();
    }
    if (opt_port == 0)
        usage();
}

static void report(double window_s, double cpu_user, double cpu_sys)
{
    uint64_t outstanding = 0;
    int dead = 0;
    for (int i = 0; i < opt_conns; i++) {
        outstanding += conns[i].outstanding;
        dead += conns[i].dead;
    }
    uint64_t errors = err_closed + err_protocol + err_unmatched + err_bad_code + err_lost;
    printf("{\"tool\":\"loadgen\",\"mode\":\"%s\",\"target\":\"%s:%d\",\"conns\":%d,\"inflight\":%d,"
           "\"rate\":%.0f,\"body\":%d,\"topics\":%d,\"pull_pct\":%d,\"tick_us\":%d,"
           "\"warmup_s\":%.3f,\"duration_s\":%.3f,",
           opt_rate > 0 ? "open" : "closed", opt_host, opt_port, opt_conns, opt_rate > 0 ? 0 : opt_inflight,
           opt_rate, opt_body, opt_topics, opt_pull_pct, opt_tick_us, opt_warmup, window_s);
    printf("\"sent\":%llu,\"pulls\":%llu,\"responses\":%llu,\"rps\":%.1f,\"send_rate\":%.1f,"
           "\"bytes_out\":%llu,\"bytes_in\":%llu,\"skipped\":%llu,\"outstanding_at_end\":%llu,",
           (unsigned long long)sent_w, (unsigned long long)pulls_w, (unsigned long long)resp_w,
           (double)resp_w / window_s, (double)sent_w / window_s, (unsigned long long)bytes_out_w,
           (unsigned long long)bytes_in_w, (unsigned long long)skipped_w, (unsigned long long)outstanding);
    printf("\"lat_us\":{\"min\":%.1f,\"mean\":%.1f,\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f,\"p999\":%.1f,"
           "\"p9999\":%.1f,\"max\":%.1f},",
           hist_n ? (double)lat_min / 1000.0 : 0.0, hist_n ? lat_sum / (double)hist_n / 1000.0 : 0.0,
           percentile_us(0.50), percentile_us(0.90), percentile_us(0.99), percentile_us(0.999),
           percentile_us(0.9999), (double)lat_max / 1000.0);
    printf("\"errors\":%llu,\"error_detail\":{\"conn_closed\":%llu,\"protocol\":%llu,\"unmatched\":%llu,"
           "\"bad_code\":%llu,\"lost\":%llu},\"dead_conns\":%d,\"server_requests\":%llu,\"resp_codes\":{",
           (unsigned long long)errors, (unsigned long long)err_closed, (unsigned long long)err_protocol,
           (unsigned long long)err_unmatched, (unsigned long long)err_bad_code, (unsigned long long)err_lost,
           dead, (unsigned long long)server_requests);
    for (int i = 0; i < ncodes; i++)
        printf("%s\"%d\":%llu", i ? "," : "", (int)(int32_t)(uint32_t)codes[i][0], (unsigned long long)codes[i][1]);
    printf("},\"cpu_user_s\":%.3f,\"cpu_sys_s\":%.3f}\n", cpu_user, cpu_sys);
}

static double tv_s(struct timeval tv)
{
    return (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
}

int main(int argc, char **argv)
{
    parse_args(argc, argv);
    signal(SIGPIPE, SIG_IGN);

    send_t = calloc((size_t)opt_topics, sizeof *send_t);
    pull_t = calloc((size_t)opt_topics, sizeof *pull_t);
    body_bytes = malloc((size_t)opt_body + 1);
    conns = calloc((size_t)opt_conns, sizeof *conns);
    if (!send_t || !pull_t || !body_bytes || !conns)
        die("calloc");
    for (int i = 0; i < opt_topics; i++) {
        build_send(&send_t[i], i);
        build_pull(&pull_t[i], i);
    }
    uint32_t x = 2463534242u; /* xorshift: printable, not trivially compressible */
    for (int i = 0; i < opt_body; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        body_bytes[i] = (uint8_t)('!' + x % 94);
    }
    char *u = uniq_prefix;
    u = put_hex(u, 0x7F000001u, 8);
    u = put_hex(u, (uint64_t)getpid() & 0xFFFF, 4);
    put_hex(u, 0x1B6D8A3Cu, 8);

    ep = epoll_create1(0);
    if (ep < 0)
        die("epoll_create1");
    connect_all();

    int closed_loop = opt_rate == 0;
    int tfd = -1;
    uint64_t t0 = now_ns();
    t_measure = t0 + (uint64_t)(opt_warmup * 1e9);
    t_end = t_measure + (uint64_t)(opt_duration * 1e9);
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    born_ms = (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000;
    if (closed_loop) {
        for (int i = 0; i < opt_conns; i++) {
            for (int k = 0; k < opt_inflight; k++)
                queue_request(&conns[i], t0);
            flush_out(&conns[i]);
        }
    } else {
        tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
        if (tfd < 0)
            die("timerfd_create");
        struct itimerspec its = {
            .it_interval = {.tv_sec = 0, .tv_nsec = opt_tick_us * 1000L},
            .it_value = {.tv_sec = 0, .tv_nsec = opt_tick_us * 1000L},
        };
        timerfd_settime(tfd, 0, &its, NULL);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
        epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev);
    }

    struct epoll_event evs[512];
    struct rusage ru0 = {0}; /* our CPU time when the measured window opened */
    int window_open = 0;
    for (;;) {
        uint64_t now = now_ns();
        if (now >= t_end)
            break;
        if (!window_open && now >= t_measure) {
            getrusage(RUSAGE_SELF, &ru0);
            window_open = 1;
        }
        int timeout_ms = (int)((t_end - now) / 1000000) + 1;
        if (timeout_ms > 100)
            timeout_ms = 100;
        int n = epoll_wait(ep, evs, 512, timeout_ms);
        clock_gettime(CLOCK_REALTIME, &wall);
        born_ms = (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000;
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (c == NULL) {
                uint64_t ticks;
                if (read(tfd, &ticks, sizeof ticks) < 0 && errno != EAGAIN)
                    die("read timerfd");
                open_loop_tick(t0, now_ns());
                continue;
            }
            if (c->dead)
                continue;
            if (evs[i].events & EPOLLOUT)
                flush_out(c);
            if (!c->dead && (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)))
                on_readable(c, closed_loop);
        }
    }
    double window_s = (double)(now_ns() - t_measure) / 1e9;
    if (window_s <= 0)
        window_s = opt_duration;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    report(window_s, tv_s(ru.ru_utime) - tv_s(ru0.ru_utime), tv_s(ru.ru_stime) - tv_s(ru0.ru_stime));
    return 0;
}
