/*
 * relayfloor.c: a minimal TCP relay the bench can put between the load generator and the null
 * broker, to measure what one more user-space hop costs on the machine at hand.
 *
 * Why: the open-loop goal (added p99 over direct) is set against the machine as much as against
 * the proxy.  HAProxy in `mode tcp` is the production baseline; this is the bare one: one
 * thread, one level-triggered epoll set, one plain read (64 KiB buffer; HAProxy's default is
 * 16 KiB) and one plain write per readable socket, no parsing, no timers, no logging, nothing
 * allocated per read.  A proxy that matches it on latency adds nothing measurable of its own on
 * that machine; a latency goal it misses is decided by the machine.  It is not a CPU floor:
 * batched system calls (io_uring) cost less than its plain ones.
 *
 * Each accepted connection gets one upstream connection (a blocking connect: loopback).  The
 * bytes read from one side wait in that side's 64 KiB buffer until the other side took them
 * all; meanwhile the side is not read again (back pressure), and the other side is watched for
 * EPOLLOUT.  An end of stream or an error on either side closes both.
 *
 * Usage: relayfloor --upstream PORT [--port 0] [--host 127.0.0.1]
 * Prints "listening HOST:PORT" on stdout once bound (port 0: the OS picks); exits on SIGTERM or
 * SIGINT.  Not a product: no half-close, no limits, no TLS, loopback bench use only.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define BUF 65536
#define MAX_EVENTS 256

struct side {
    int fd;
    int dead;
    struct side *peer;
    size_t off, len; /* buf[off:len]: read from this side, not yet written to the peer */
    char buf[BUF];
};

static int ep;
static volatile sig_atomic_t stopping;
static struct side *graveyard[2 * MAX_EVENTS]; /* closed this iteration, freed after it */
static int ngrave;

static void die(const char *what)
{
    fprintf(stderr, "relayfloor: %s: %s\n", what, strerror(errno));
    exit(2);
}

static void on_signal(int sig)
{
    (void)sig;
    stopping = 1;
}

static void watch(struct side *s, int op, unsigned events)
{
    struct epoll_event ev = {.events = events, .data.ptr = s};
    if (epoll_ctl(ep, op, s->fd, &ev) < 0)
        die("epoll_ctl");
}

static void close_pair(struct side *s)
{
    struct side *sides[2] = {s, s->peer};
    for (int i = 0; i < 2; i++) {
        if (sides[i]->dead)
            continue;
        sides[i]->dead = 1;
        close(sides[i]->fd); /* also leaves the epoll set */
        graveyard[ngrave++] = sides[i]; /* at most 2 per event: it cannot fill */
    }
}

/* Write what `from` holds to its peer; 1 when all of it went, 0 when some waits, -1 on error. */
static int flush(struct side *from)
{
    while (from->off < from->len) {
        ssize_t w = send(from->peer->fd, from->buf + from->off, from->len - from->off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno == EAGAIN ? 0 : -1;
        }
        from->off += (size_t)w;
    }
    from->off = from->len = 0;
    return 1;
}

/* Watch a side for what its state asks: reading while its own buffer is empty, writing while
 * its peer's holds bytes for it. */
static void rearm(struct side *s)
{
    watch(s, EPOLL_CTL_MOD, (s->len ? 0u : EPOLLIN) | (s->peer->len ? EPOLLOUT : 0u));
}

static void on_readable(struct side *s)
{
    if (s->len)
        return; /* still waiting for the peer to take the last read */
    ssize_t n = recv(s->fd, s->buf, BUF, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        close_pair(s);
        return;
    }
    if (n < 0)
        return;
    s->len = (size_t)n;
    int r = flush(s);
    if (r < 0) {
        close_pair(s);
    } else if (r == 0) { /* back pressure: stop reading s until its peer took it all */
        rearm(s);
        rearm(s->peer);
    }
}

static void on_writable(struct side *s)
{
    int r = flush(s->peer);
    if (r < 0) {
        close_pair(s);
    } else if (r == 1) {
        rearm(s);
        rearm(s->peer);
    }
}

static int connect_upstream(const char *host, int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void on_accept(int lfd, const char *host, int upstream)
{
    for (;;) {
        int cfd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (cfd < 0) {
            if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)
                return;
            /* out of descriptors (or worse): the pending connection would stay queued and the
             * level-triggered listener report it forever; a bench tool stops instead */
            die("accept4");
        }
        int ufd = connect_upstream(host, upstream);
        if (ufd < 0) {
            close(cfd);
            continue;
        }
        int one = 1;
        int fl = fcntl(ufd, F_GETFL);
        if (fl < 0 || fcntl(ufd, F_SETFL, fl | O_NONBLOCK) < 0) {
            close(cfd);
            close(ufd);
            continue;
        }
        setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        setsockopt(ufd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct side *c = calloc(1, sizeof *c), *u = calloc(1, sizeof *u);
        if (c == NULL || u == NULL)
            die("calloc");
        c->fd = cfd;
        u->fd = ufd;
        c->peer = u;
        u->peer = c;
        watch(c, EPOLL_CTL_ADD, EPOLLIN);
        watch(u, EPOLL_CTL_ADD, EPOLLIN);
    }
}

static int num_arg(const char *name, const char *v, int lo, int hi)
{
    char *end;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < lo || x > hi) {
        fprintf(stderr, "relayfloor: %s %s is not allowed; expected a number from %d to %d\n", name, v, lo, hi);
        exit(2);
    }
    return (int)x;
}

int main(int argc, char **argv)
{
    const char *host = "127.0.0.1";
    int port = 0, upstream = 0;
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) {
            fprintf(stderr, "usage: relayfloor --upstream PORT [--port 0] [--host 127.0.0.1]\n");
            return 2;
        }
        if (!strcmp(argv[i], "--upstream"))
            upstream = num_arg(argv[i], argv[i + 1], 1, 65535);
        else if (!strcmp(argv[i], "--port"))
            port = num_arg(argv[i], argv[i + 1], 0, 65535);
        else if (!strcmp(argv[i], "--host"))
            host = argv[i + 1];
        else {
            fprintf(stderr, "relayfloor: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (upstream == 0) {
        fprintf(stderr, "usage: relayfloor --upstream PORT [--port 0] [--host 127.0.0.1]\n");
        return 2;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0)
        die("socket");
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
        fprintf(stderr, "relayfloor: --host %s is not an IPv4 address\n", host);
        return 2;
    }
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0)
        die("bind");
    if (listen(lfd, 4096) < 0)
        die("listen");
    socklen_t alen = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &alen);
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0)
        die("epoll_create1");
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &lev) < 0)
        die("epoll_ctl");
    printf("listening %s:%d\n", host, ntohs(a.sin_port));
    fflush(stdout);

    struct epoll_event evs[MAX_EVENTS];
    while (!stopping) {
        int n = epoll_wait(ep, evs, MAX_EVENTS, 1000);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            struct side *s = evs[i].data.ptr;
            if (s == NULL) {
                on_accept(lfd, host, upstream);
                continue;
            }
            if (!s->dead && (evs[i].events & EPOLLOUT))
                on_writable(s);
            if (!s->dead && (evs[i].events & (EPOLLHUP | EPOLLERR)) && s->len)
                close_pair(s); /* reported even while not read: would spin */
            if (!s->dead && (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)))
                on_readable(s);
        }
        for (int i = 0; i < ngrave; i++) /* close_pair ends both sides of a pair at once */
            free(graveyard[i]);
        ngrave = 0;
    }
    return 0;
}
