/*
 * nullbroker.c: a RocketMQ "broker" that stores nothing and answers at once.
 *
 * It is the ceiling of the rmqfast benchmark (the "direct" target) and the upstream of the
 * proxies under test, so it answers like a real broker but costs as little as possible:
 *
 *   - SEND_MESSAGE 10 / SEND_MESSAGE_V2 310 / SEND_BATCH_MESSAGE 320: code 0, same opaque,
 *     flag 1, extFields queueId (the requested one, or a "random" one when it is < 0),
 *     TRACE_ON, MSG_REGION, msgId (offsetMsgId: store host + commit-log offset, hex) and
 *     queueOffset; that is what SendMessageProcessor answers, and what the Java client reads
 *     unconditionally (MSG_REGION: null extFields would NPE it).
 *   - PULL_MESSAGE 11 / LITE_PULL_MESSAGE 361: FOUND (0) with the PullMessageResponseHeader
 *     fields and a body of --pull-msgs store records of --pull-body bytes, built once.
 *   - anything else (heartbeats...): a bare SUCCESS.  Oneway requests and responses: nothing.
 *
 * Why it is never the bottleneck: one level-triggered epoll loop per thread (SO_REUSEPORT
 * listeners); a readable connection is read once (up to the free part of a 256 KiB buffer),
 * every whole frame in it is answered into one output buffer, and that buffer leaves with a
 * single send().  Per frame: a few memmem/memcpy and integer formatting, no allocation.  A
 * connection whose output does not drain stops being read until it does (backpressure, so a
 * slow reader cannot make us buffer without bound).
 *
 * Usage: nullbroker [--host 127.0.0.1] [--port 0] [--threads 1] [--pull-msgs 16]
 *                   [--pull-body 1024]
 * Prints "listening HOST:PORT" on stdout once bound (port 0 picks a free one); on SIGTERM or
 * SIGINT prints one JSON line of counters and exits 0.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "remoting.h"

#define IN_CAP (256 * 1024)
#define OUT_CAP (256 * 1024)
#define MAX_THREADS 64

struct conn {
    int fd;
    int paused; /* waiting for EPOLLOUT, not reading */
    uint8_t *in;
    size_t in_len, in_cap;
    uint8_t *out;
    size_t out_len, out_off, out_cap;
};

struct worker {
    pthread_t tid;
    int lfd, ep;
    uint64_t requests, responses, oneway, bytes_in, bytes_out, conns, protocol_errors;
    uint64_t commit_offset;    /* "commit log" position: grows by each stored frame */
    uint64_t queue_offset[256]; /* per queue id */
};

static volatile sig_atomic_t stopping;
static const char *opt_host = "127.0.0.1";
static int opt_port;
static int opt_threads = 1;
static int opt_pull_msgs = 16;
static int opt_pull_body = 1024;
static uint8_t *pull_blob; /* the body of every pull answer */
static size_t pull_blob_len;

static void on_signal(int sig)
{
    (void)sig;
    stopping = 1;
}

static void die(const char *what)
{
    perror(what);
    exit(2);
}

static void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n);
    if (p == NULL)
        die("realloc");
    return p;
}

/* Store records as a pull body carries them (MessageDecoder, MESSAGE_MAGIC_CODE V1): the
 * relay forwards them untouched, so only the size and a plausible shape matter. */
static void build_pull_blob(void)
{
    static const char topic[] = "BenchTopic";
    static const char props[] = "UNIQ_KEY\x01" "7F0000010000000000000000000000\x02TAGS\x01TagA\x02";
    size_t tlen = sizeof(topic) - 1, plen = sizeof(props) - 1;
    size_t rec = 4 + 4 + 4 + 4 + 4 + 8 + 8 + 4 + 8 + 8 + 8 + 8 + 4 + 8 + 4 + (size_t)opt_pull_body
                 + 1 + tlen + 2 + plen;
    pull_blob_len = rec * (size_t)opt_pull_msgs;
    pull_blob = xrealloc(NULL, pull_blob_len ? pull_blob_len : 1);
    for (int i = 0; i < opt_pull_msgs; i++) {
        uint8_t *p = pull_blob + rec * (size_t)i;
        wr_be32(p, (uint32_t)rec);              /* TOTALSIZE */
        wr_be32(p + 4, 0xDAA320A7u);            /* MAGICCODE V1 */
        wr_be32(p + 8, 0);                      /* BODYCRC */
        wr_be32(p + 12, 0);                     /* QUEUEID */
        wr_be32(p + 16, 0);                     /* FLAG */
        wr_be64(p + 20, (uint64_t)i);           /* QUEUEOFFSET */
        wr_be64(p + 28, rec * (uint64_t)i);     /* PHYSICALOFFSET */
        wr_be32(p + 36, 0);                     /* SYSFLAG */
        wr_be64(p + 40, 1700000000000ULL);      /* BORNTIMESTAMP */
        wr_be32(p + 48, 0x7F000001u);           /* BORNHOST ip */
        wr_be32(p + 52, 40000);                 /*          port */
        wr_be64(p + 56, 1700000000001ULL);      /* STORETIMESTAMP */
        wr_be32(p + 64, 0x7F000001u);           /* STOREHOST ip */
        wr_be32(p + 68, 10911);                 /*           port */
        wr_be32(p + 72, 0);                     /* RECONSUMETIMES */
        wr_be64(p + 76, 0);                     /* PREPARED TRANSACTION OFFSET */
        wr_be32(p + 84, (uint32_t)opt_pull_body); /* BODY */
        memset(p + 88, 'm', (size_t)opt_pull_body);
        uint8_t *q = p + 88 + opt_pull_body;
        *q++ = (uint8_t)tlen;                   /* TOPIC (1-byte length in V1) */
        memcpy(q, topic, tlen);
        q += tlen;
        *q++ = (uint8_t)(plen >> 8);            /* PROPERTIES */
        *q++ = (uint8_t)plen;
        memcpy(q, props, plen);
    }
}

/* Write the two length words in front of a header that ends at `end`, return frame size. */
static size_t finish_frame(uint8_t *frame, const char *end, size_t body_len)
{
    size_t hlen = (size_t)(end - (const char *)(frame + 8));
    wr_be32(frame, (uint32_t)(4 + hlen + body_len));
    wr_be32(frame + 4, (uint32_t)hlen); /* serialize type 0 = JSON */
    return 8 + hlen;
}

/* Queue id a send asked for: extFields "e" (V2, batch) or "queueId" (V1); -1 if absent. */
static int requested_queue(const uint8_t *h, uint32_t hlen, int32_t code)
{
    const uint8_t *p;
    size_t k;
    if (code == RMQ_SEND_MESSAGE) {
        p = memmem(h, hlen, "\"queueId\":", 10);
        k = 10;
    } else {
        p = memmem(h, hlen, "\"e\":", 4);
        k = 4;
    }
    if (p == NULL)
        return -1;
    return json_int_at(p + k, h + hlen);
}

/* Append the answer to one request; returns bytes appended.  The caller made room for
 * 1024 + pull_blob_len bytes. */
static size_t answer(struct worker *w, uint8_t *dst, const struct rmq_head *rq,
                     const uint8_t *h, uint32_t hlen, uint32_t frame_len)
{
    char *p = (char *)dst + 8;
    int32_t code = rq->code;
    if (code == RMQ_SEND_MESSAGE_V2 || code == RMQ_SEND_MESSAGE || code == RMQ_SEND_BATCH_MESSAGE) {
        int qid = requested_queue(h, hlen, code);
        if (qid < 0)
            qid = (int)(w->commit_offset % 4); /* the broker picks one */
        uint64_t commit = w->commit_offset;
        w->commit_offset += frame_len;
        uint64_t qoff = w->queue_offset[qid & 255]++;
        PUT_LIT(p, "{\"code\":0,\"extFields\":{\"queueId\":\"");
        p = put_u64(p, (uint64_t)qid);
        PUT_LIT(p, "\",\"TRACE_ON\":\"true\",\"MSG_REGION\":\"DefaultRegion\",\"msgId\":\"7F00000100002A9F");
        p = put_hex(p, commit, 16);
        PUT_LIT(p, "\",\"queueOffset\":\"");
        p = put_u64(p, qoff);
        PUT_LIT(p, "\"},\"flag\":1,\"language\":\"JAVA\",\"opaque\":");
        p = put_i64(p, rq->opaque);
        PUT_LIT(p, ",\"serializeTypeCurrentRPC\":\"JSON\",\"version\":435}");
        return finish_frame(dst, p, 0);
    }
    if (code == RMQ_PULL_MESSAGE || code == RMQ_LITE_PULL_MESSAGE) {
        uint64_t next = w->queue_offset[255] += (uint64_t)opt_pull_msgs;
        PUT_LIT(p, "{\"code\":0,\"extFields\":{\"suggestWhichBrokerId\":\"0\",\"nextBeginOffset\":\"");
        p = put_u64(p, next);
        PUT_LIT(p, "\",\"minOffset\":\"0\",\"maxOffset\":\"");
        p = put_u64(p, next);
        PUT_LIT(p, "\"},\"flag\":1,\"language\":\"JAVA\",\"opaque\":");
        p = put_i64(p, rq->opaque);
        PUT_LIT(p, ",\"serializeTypeCurrentRPC\":\"JSON\",\"version\":435}");
        size_t n = finish_frame(dst, p, pull_blob_len);
        memcpy(dst + n, pull_blob, pull_blob_len);
        return n + pull_blob_len;
    }
    PUT_LIT(p, "{\"code\":0,\"flag\":1,\"language\":\"JAVA\",\"opaque\":");
    p = put_i64(p, rq->opaque);
    PUT_LIT(p, ",\"serializeTypeCurrentRPC\":\"JSON\",\"version\":435}");
    return finish_frame(dst, p, 0);
}

static void conn_close(struct worker *w, struct conn *c)
{
    epoll_ctl(w->ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

static void set_events(struct worker *w, struct conn *c, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.ptr = c};
    epoll_ctl(w->ep, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Send what is queued; 0 = all out (or would block), -1 = connection gone. */
static int flush_out(struct worker *w, struct conn *c)
{
    while (c->out_off < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (!c->paused) {
                    c->paused = 1;
                    set_events(w, c, EPOLLOUT);
                }
                return 0;
            }
            return -1;
        }
        c->out_off += (size_t)n;
        w->bytes_out += (uint64_t)n;
    }
    c->out_off = c->out_len = 0;
    if (c->paused) {
        c->paused = 0;
        set_events(w, c, EPOLLIN);
    }
    return 0;
}

/* One read, answer every whole frame, one send.  Returns -1 when the connection is gone. */
static int on_readable(struct worker *w, struct conn *c)
{
    ssize_t n = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
    if (n == 0)
        return -1;
    if (n < 0)
        return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    c->in_len += (size_t)n;
    w->bytes_in += (uint64_t)n;
    size_t pos = 0;
    while (c->in_len - pos >= 8) {
        uint8_t *f = c->in + pos;
        uint32_t len = rd_be32(f);
        if (len < 4 || len > RMQ_MAX_FRAME - 4) {
            w->protocol_errors++;
            return -1;
        }
        if (c->in_len - pos < 4 + (size_t)len) {
            if (4 + (size_t)len > c->in_cap) { /* a frame bigger than the buffer: grow */
                c->in_cap = 4 + (size_t)len;
                c->in = xrealloc(c->in, c->in_cap);
            }
            break;
        }
        uint32_t mark = rd_be32(f + 4);
        uint32_t hlen = mark & 0xFFFFFF;
        struct rmq_head rq;
        if (hlen > len - 4 || rmq_parse_head(f + 8, hlen, (int)(mark >> 24), &rq) != 0) {
            w->protocol_errors++;
            return -1;
        }
        pos += 4 + (size_t)len;
        if (rq.flag & RMQ_FLAG_RESPONSE)
            continue; /* a client answering one of our requests: we send none */
        w->requests++;
        if (rq.flag & RMQ_FLAG_ONEWAY) {
            w->oneway++;
            continue;
        }
        size_t need = 1024 + pull_blob_len;
        if (c->out_cap - c->out_len < need) {
            c->out_cap = c->out_len + need > 2 * c->out_cap ? c->out_len + need : 2 * c->out_cap;
            c->out = xrealloc(c->out, c->out_cap);
        }
        c->out_len += answer(w, c->out + c->out_len, &rq, f + 8, hlen, 4 + len);
        w->responses++;
    }
    if (pos) {
        memmove(c->in, c->in + pos, c->in_len - pos);
        c->in_len -= pos;
    }
    return flush_out(w, c);
}

static int listen_socket(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0)
        die("socket");
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, opt_host, &a.sin_addr) != 1) {
        fprintf(stderr, "nullbroker: --host %s is not an IPv4 address\n", opt_host);
        exit(2);
    }
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0)
        die("bind");
    if (listen(fd, 4096) < 0)
        die("listen");
    return fd;
}

static void on_accept(struct worker *w)
{
    for (;;) {
        int fd = accept4(w->lfd, NULL, NULL, SOCK_NONBLOCK);
        if (fd < 0)
            return; /* EAGAIN: another thread took it, or the queue is empty */
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct conn *c = calloc(1, sizeof *c);
        if (c == NULL)
            die("calloc");
        c->fd = fd;
        c->in_cap = IN_CAP;
        c->in = xrealloc(NULL, IN_CAP);
        c->out_cap = OUT_CAP;
        c->out = xrealloc(NULL, OUT_CAP);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(w->ep, EPOLL_CTL_ADD, fd, &ev) < 0)
            die("epoll_ctl");
        w->conns++;
    }
}

static void *run(void *arg)
{
    struct worker *w = arg;
    struct epoll_event evs[256];
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(w->ep, EPOLL_CTL_ADD, w->lfd, &lev) < 0)
        die("epoll_ctl");
    while (!stopping) {
        /* The timeout only bounds how late a stop signal is noticed by other threads. */
        int n = epoll_wait(w->ep, evs, 256, 200);
        for (int i = 0; i < n; i++) {
            struct conn *c = evs[i].data.ptr;
            if (c == NULL) {
                on_accept(w);
                continue;
            }
            int rc = 0;
            if (evs[i].events & EPOLLOUT)
                rc = flush_out(w, c);
            else if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP))
                rc = on_readable(w, c);
            if (rc < 0)
                conn_close(w, c);
        }
    }
    return NULL;
}

static int int_arg(const char *name, const char *v, int lo, int hi)
{
    char *end;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < lo || x > hi) {
        fprintf(stderr, "nullbroker: %s %s is not allowed; expected an integer from %d to %d\n", name, v, lo, hi);
        exit(2);
    }
    return (int)x;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) {
            fprintf(stderr, "usage: nullbroker [--host H] [--port P] [--threads N] [--pull-msgs N] [--pull-body BYTES]\n");
            return 2;
        }
        if (!strcmp(a, "--host"))
            opt_host = v;
        else if (!strcmp(a, "--port"))
            opt_port = int_arg(a, v, 0, 65535);
        else if (!strcmp(a, "--threads"))
            opt_threads = int_arg(a, v, 1, MAX_THREADS);
        else if (!strcmp(a, "--pull-msgs"))
            opt_pull_msgs = int_arg(a, v, 0, 1024);
        else if (!strcmp(a, "--pull-body"))
            opt_pull_body = int_arg(a, v, 0, 4 * 1024 * 1024);
        else {
            fprintf(stderr, "nullbroker: unknown option %s\n", a);
            return 2;
        }
        i++;
    }
    build_pull_blob();
    struct sigaction sa = {.sa_handler = on_signal}; /* no SA_RESTART: epoll_wait returns */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    static struct worker ws[MAX_THREADS];
    int port = opt_port;
    for (int t = 0; t < opt_threads; t++) {
        ws[t].lfd = listen_socket(port);
        if (port == 0) { /* the first bind picked the port; the others share it */
            struct sockaddr_in a;
            socklen_t al = sizeof a;
            getsockname(ws[t].lfd, (struct sockaddr *)&a, &al);
            port = ntohs(a.sin_port);
        }
        ws[t].ep = epoll_create1(0);
        if (ws[t].ep < 0)
            die("epoll_create1");
    }
    printf("listening %s:%d\n", opt_host, port);
    fflush(stdout);
    for (int t = 0; t < opt_threads; t++)
        if (pthread_create(&ws[t].tid, NULL, run, &ws[t]) != 0)
            die("pthread_create");
    uint64_t req = 0, resp = 0, ow = 0, bin = 0, bout = 0, conns = 0, perr = 0;
    for (int t = 0; t < opt_threads; t++) {
        pthread_join(ws[t].tid, NULL);
        req += ws[t].requests;
        resp += ws[t].responses;
        ow += ws[t].oneway;
        bin += ws[t].bytes_in;
        bout += ws[t].bytes_out;
        conns += ws[t].conns;
        perr += ws[t].protocol_errors;
    }
    printf("{\"tool\":\"nullbroker\",\"requests\":%llu,\"responses\":%llu,\"oneway\":%llu,"
           "\"bytes_in\":%llu,\"bytes_out\":%llu,\"connections\":%llu,\"protocol_errors\":%llu}\n",
           (unsigned long long)req, (unsigned long long)resp, (unsigned long long)ow,
           (unsigned long long)bin, (unsigned long long)bout, (unsigned long long)conns,
           (unsigned long long)perr);
    return 0;
}
