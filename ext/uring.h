/*
 * uring.h: a minimal io_uring submission/completion ring for the reactor (no liburing needed).
 *
 * The reactor uses it for one thing only: to issue the receives and sends of every pump it steps
 * in one event-loop turn with one system call, instead of one each.  Every operation carries
 * MSG_DONTWAIT, which makes the kernel complete it inline during io_uring_enter (bytes moved, or
 * -EAGAIN), never later: after rmq_uring_submit returns, each submitted operation has its
 * completion in the ring, exactly as if send(2)/recv(2) had been called in turn.  rmq_uring_init
 * checks that on the running kernel (rmq_uring_selftest) and refuses the ring otherwise; the
 * reactor then makes the plain system calls, as without io_uring.
 *
 * One thread uses a ring (no SQPOLL): the submission tail is ours alone, the kernel only moves
 * the heads it consumes.  Memory order: the tails we publish are stored with release, the
 * kernel's tails are loaded with acquire (the protocol of the io_uring man pages).
 */
#ifndef RMQ_URING_H
#define RMQ_URING_H

#include <errno.h>
#include <arpa/inet.h>
#include <linux/io_uring.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct rmq_uring {
    int fd;
    unsigned sq_entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqes_len;
    unsigned local_tail;   /* SQEs prepared and not yet published to the kernel */
    unsigned published;    /* tail published to the kernel by the last submit */
    int op_flags;          /* MSG_DONTWAIT (a test may clear it, to leave an operation in the kernel) */
} rmq_uring;

static inline void rmq_uring_zero(rmq_uring *r) { memset(r, 0, sizeof *r); r->fd = -1; }

static void rmq_uring_free(rmq_uring *r)
{
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->cq_ptr && r->cq_ptr != r->sq_ptr && r->cq_ptr != MAP_FAILED) munmap(r->cq_ptr, r->cq_len);
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED) munmap(r->sq_ptr, r->sq_len);
    if (r->fd >= 0) close(r->fd);
    rmq_uring_zero(r);
}

/* Room for one more operation?  (Each pump has at most one queued; the reactor submits when full.) */
static inline int rmq_uring_full(const rmq_uring *r)
{
    return r->local_tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE) >= r->sq_entries;
}

/* Queue a receive (IORING_OP_RECV) or send (IORING_OP_SEND); -1 when the ring is full. */
static inline int rmq_uring_prep(rmq_uring *r, int op, int fd, void *buf, unsigned len, int flags, uint64_t data)
{
    unsigned idx;
    struct io_uring_sqe *sqe;
    if (rmq_uring_full(r)) return -1;
    idx = r->local_tail & *r->sq_mask;
    sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = (uint8_t)op;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = len;
    sqe->msg_flags = (uint32_t)flags;
    sqe->user_data = data;
    r->sq_array[idx] = idx;
    r->local_tail++;
    return 0;
}

static inline int rmq_uring_prep_send(rmq_uring *r, int fd, const void *buf, unsigned len, uint64_t data)
{
    return rmq_uring_prep(r, IORING_OP_SEND, fd, (void *)buf, len, MSG_NOSIGNAL | r->op_flags, data);
}

static inline int rmq_uring_prep_recv(rmq_uring *r, int fd, void *buf, unsigned len, uint64_t data)
{
    return rmq_uring_prep(r, IORING_OP_RECV, fd, buf, len, r->op_flags, data);
}

/* Queue the cancellation of the operation whose data is ``target`` (its own completion has data 0). */
static inline int rmq_uring_prep_cancel(rmq_uring *r, uint64_t target)
{
    return rmq_uring_prep(r, IORING_OP_ASYNC_CANCEL, -1, (void *)(uintptr_t)target, 0, 0, 0);
}

/* Forget the prepared operations the kernel has not consumed (after a failed submit). */
static inline void rmq_uring_rewind(rmq_uring *r)
{
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    __atomic_store_n(r->sq_tail, head, __ATOMIC_RELEASE);
    r->local_tail = r->published = head;
}

/* Submit every prepared operation with one io_uring_enter; wait for at least ``wait`` completions
 * in the same call.  Returns the number the kernel consumed, or -errno (nothing consumed). */
static inline int rmq_uring_submit(rmq_uring *r, unsigned wait)
{
    unsigned n = r->local_tail - r->published;
    long ret;
    __atomic_store_n(r->sq_tail, r->local_tail, __ATOMIC_RELEASE);
    r->published = r->local_tail;
    do {
        ret = syscall(__NR_io_uring_enter, r->fd, n, wait, wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
    } while (ret < 0 && errno == EINTR);
    if (ret < 0) return -errno;
    return (int)ret;
}

/* The next completion: 1 with its data and result, 0 when there is none. */
static inline int rmq_uring_reap(rmq_uring *r, uint64_t *data, int *res)
{
    unsigned head = *r->cq_head;
    struct io_uring_cqe *cqe;
    if (head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) return 0;
    cqe = &r->cqes[head & *r->cq_mask];
    *data = cqe->user_data;
    *res = cqe->res;
    __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
    return 1;
}

/* Does the kernel complete MSG_DONTWAIT socket operations inline, as the reactor needs?  On a TCP
 * loopback connection: a receive on an empty socket must complete with -EAGAIN within the
 * submitting call, a send must complete with its byte count, the receive after it must get that
 * byte, and a send into a full socket buffer must complete with -EAGAIN (or the part that fit)
 * within the call too.  0, or a reason. */
static const char *rmq_uring_selftest(rmq_uring *r)
{
    /* static: should an operation be left armed after all, it targets no stack frame */
    static char out = 'x', in = 0;
    static char fill[65536];
    int sv[2] = {-1, -1}, ls = -1, res, got, small = 4096;
    uint64_t data;
    socklen_t len;
    struct sockaddr_in a;
    const char *why = NULL;
    in = 0;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    len = sizeof a;
    ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sv[1] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0 || sv[1] < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) < 0 || listen(ls, 1) < 0
        || getsockname(ls, (struct sockaddr *)&a, &len) < 0 || connect(sv[1], (struct sockaddr *)&a, sizeof a) < 0
        || (sv[0] = accept4(ls, NULL, NULL, SOCK_CLOEXEC)) < 0) {
        why = "no loopback TCP connection for the check";
        goto out;
    }
    /* small buffers, so that the sending side fills up after a few sends */
    setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
    setsockopt(sv[0], SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    for (int step = 0; step < 3 && why == NULL; step++) {
        if (step == 0) rmq_uring_prep_recv(r, sv[0], &in, 1, 1);
        else if (step == 1) rmq_uring_prep_send(r, sv[1], &out, 1, 2);
        else rmq_uring_prep_recv(r, sv[0], &in, 1, 3);
        if (step == 2) usleep(1000);  /* loopback delivery is synchronous; this is a margin */
        if (rmq_uring_submit(r, 0) != 1) { why = "io_uring_enter did not take a socket operation"; break; }
        got = rmq_uring_reap(r, &data, &res);
        if (!got || data != (uint64_t)(step + 1)) { why = "a MSG_DONTWAIT socket operation did not complete inline"; break; }
        if (step == 0 && res != -EAGAIN) why = "a receive on an empty socket did not end with EAGAIN";
        if (step == 1 && res != 1) why = "a send did not complete";
        if (step == 2 && (res != 1 || in != 'x')) why = "a receive did not get the byte sent";
    }
    /* fill the connection until a send cannot go on: each must still complete within its call */
    for (int i = 0; i < 256 && why == NULL; i++) {
        if (rmq_uring_prep_send(r, sv[1], fill, sizeof fill, 4) < 0 || rmq_uring_submit(r, 0) != 1) {
            why = "io_uring_enter did not take a socket operation";
            break;
        }
        if (!rmq_uring_reap(r, &data, &res) || data != 4) { why = "a send into a full socket did not complete inline"; break; }
        if (res == -EAGAIN) break;
        if (res <= 0) why = "a send into a full socket failed";
        else if (i == 255) why = "the check's socket never filled up";
    }
out:
    if (sv[0] >= 0) close(sv[0]);
    if (sv[1] >= 0) close(sv[1]);
    if (ls >= 0) close(ls);
    if (why) errno = 0;  /* the reason is the text, not an earlier call's errno */
    return why;
}

/* Set up a ring of ``entries`` submissions and check it (rmq_uring_selftest).  0, or a reason
 * (errno is set when a system call failed); the ring is freed on failure. */
static const char *rmq_uring_init(rmq_uring *r, unsigned entries)
{
    struct io_uring_params p;
    const char *why;
    rmq_uring_zero(r);
    memset(&p, 0, sizeof p);
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) { rmq_uring_zero(r); return "io_uring_setup failed"; }
    r->sq_entries = p.sq_entries;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_len > r->sq_len) r->sq_len = r->cq_len;
        r->cq_len = r->sq_len;
    }
    r->sq_ptr = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED) { r->sq_ptr = NULL; rmq_uring_free(r); return "mmap of the submission ring failed"; }
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED) { r->cq_ptr = NULL; rmq_uring_free(r); return "mmap of the completion ring failed"; }
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) { r->sqes = NULL; rmq_uring_free(r); return "mmap of the submission entries failed"; }
    r->sq_head = (unsigned *)((char *)r->sq_ptr + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)r->sq_ptr + p.sq_off.tail);
    r->sq_mask = (unsigned *)((char *)r->sq_ptr + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)r->sq_ptr + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)r->cq_ptr + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)r->cq_ptr + p.cq_off.tail);
    r->cq_mask = (unsigned *)((char *)r->cq_ptr + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)r->cq_ptr + p.cq_off.cqes);
    r->local_tail = r->published = *r->sq_tail;
    r->op_flags = MSG_DONTWAIT;
    why = rmq_uring_selftest(r);
    if (why) { rmq_uring_free(r); return why; }
    return NULL;
}

#endif
