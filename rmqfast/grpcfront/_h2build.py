"""cffi (API mode, out of line) build of ``rmqfast.grpcfront._h2``: libnghttp2's server session with
its callbacks in C, for :mod:`rmqfast.grpcfront.h2server`.

nghttp2 does HPACK, flow control, SETTINGS/PING/GOAWAY and RST_STREAM.  The callbacks here collect
what Python needs into one event buffer per ``nghttp2_session_mem_recv`` (the client's first
SETTINGS, request headers of a stream as one record, DATA chunks, end of stream, stream closed,
buffer drained), so Python makes one call per read and walks the records, never one callback per
header.  Responses are gRPC-framed here (5-byte prefix) into a per-stream buffer that nghttp2's data
source drains as the peer's flow-control windows allow; the trailers (``grpc-status``,
``grpc-message``) follow the last byte.

Built by ``setup.py`` (``build_ext``, also ``pip install -e .``) when ``nghttp2/nghttp2.h`` is
found (Debian: ``libnghttp2-dev``); ``python -m rmqfast.grpcfront._h2build`` builds it in place.
"""

from __future__ import annotations

import os
import sys

from cffi import FFI

CDEF = """
typedef struct h2conn h2conn;
h2conn *h2_new(uint32_t max_streams, uint32_t max_header_list, uint32_t stream_window, uint32_t conn_window);
void h2_free(h2conn *c);
int h2_recv(h2conn *c, const char *data, size_t len, char **ev, size_t *evlen);
int h2_send_out(h2conn *c, char **out, size_t *outlen, char **ev, size_t *evlen);
int h2_reply(h2conn *c, int32_t sid, const char *msg, size_t len, int has_msg, const char *trailer, size_t tlen,
             size_t mark);
int h2_reset(h2conn *c, int32_t sid, uint32_t code);
int h2_consume(h2conn *c, size_t n);
int h2_goaway(h2conn *c);
int h2_want(h2conn *c);
"""

SOURCE = r"""
#include <nghttp2/nghttp2.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

typedef struct { char *p; size_t len, cap; } buf_t;

static int buf_reserve(buf_t *b, size_t extra) {
    size_t c;
    char *n;
    if (b->len + extra <= b->cap) return 0;
    c = b->cap ? b->cap : 1024;
    while (c < b->len + extra) c *= 2;
    n = realloc(b->p, c);
    if (!n) return -1;
    b->p = n;
    b->cap = c;
    return 0;
}

static int buf_put(buf_t *b, const void *d, size_t n) {
    if (buf_reserve(b, n)) return -1;
    memcpy(b->p + b->len, d, n);
    b->len += n;
    return 0;
}

static void buf_free(buf_t *b) { free(b->p); b->p = NULL; b->len = b->cap = 0; }

typedef struct h2stream {
    buf_t hdr;          /* request: ':path' \0 'grpc-timeout' \0 then name \0 value \0 ... */
    buf_t path, tmo;
    size_t hdrsize;     /* request header list size as SETTINGS_MAX_HEADER_LIST_SIZE counts it */
    buf_t out;          /* gRPC-framed response bytes not yet taken by nghttp2 */
    size_t off;
    buf_t trl;          /* grpc-status \0 grpc-message */
    int request_seen, replied, eof, deferred, want_w;
    struct h2stream *prev, *next;  /* the connection's open streams: nghttp2_session_del calls no callback */
} h2stream;

typedef struct h2conn h2conn;
struct h2conn {
    nghttp2_session *s;
    h2stream *streams;
    buf_t ev, wr;
    size_t max_header_list;
    int oom, settings_seen;
};

/* event record: type (1 byte), stream id (4, big endian), payload length (4, big endian), payload */
static int ev_put(h2conn *c, char type, int32_t sid, const void *d, size_t n) {
    unsigned char h[9];
    h[0] = (unsigned char)type;
    h[1] = (sid >> 24) & 0xff; h[2] = (sid >> 16) & 0xff; h[3] = (sid >> 8) & 0xff; h[4] = sid & 0xff;
    h[5] = (n >> 24) & 0xff; h[6] = (n >> 16) & 0xff; h[7] = (n >> 8) & 0xff; h[8] = n & 0xff;
    if (buf_reserve(&c->ev, 9 + n)) { c->oom = 1; return -1; }
    memcpy(c->ev.p + c->ev.len, h, 9);
    if (n) memcpy(c->ev.p + c->ev.len + 9, d, n);
    c->ev.len += 9 + n;
    return 0;
}

static void stream_free(h2conn *c, h2stream *st) {
    if (st->prev) st->prev->next = st->next; else c->streams = st->next;
    if (st->next) st->next->prev = st->prev;
    buf_free(&st->hdr); buf_free(&st->path); buf_free(&st->tmo); buf_free(&st->out); buf_free(&st->trl);
    free(st);
}

static int on_begin_headers(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
    h2stream *st;
    h2conn *c;
    if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    c = ud;
    st = calloc(1, sizeof(*st));
    if (!st) return NGHTTP2_ERR_CALLBACK_FAILURE;
    if (nghttp2_session_set_stream_user_data(s, f->hd.stream_id, st)) { free(st); return 0; }
    st->next = c->streams;
    if (c->streams) c->streams->prev = st;
    c->streams = st;
    return 0;
}

#define IS(name, nlen, lit) ((nlen) == sizeof(lit) - 1 && memcmp((name), (lit), sizeof(lit) - 1) == 0)

static int on_header(nghttp2_session *s, const nghttp2_frame *f, const uint8_t *name, size_t nlen,
                     const uint8_t *value, size_t vlen, uint8_t flags, void *ud) {
    h2conn *c = ud;
    h2stream *st;
    int rc = 0;
    if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST) return 0;
    st = nghttp2_session_get_stream_user_data(s, f->hd.stream_id);
    if (!st) return 0;
    st->hdrsize += nlen + vlen + 32;
    if (st->hdrsize > c->max_header_list) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;  /* RST_STREAM */
    if (nlen && name[0] == ':') {
        if (IS(name, nlen, ":path")) { st->path.len = 0; rc = buf_put(&st->path, value, vlen); }
        return rc ? NGHTTP2_ERR_CALLBACK_FAILURE : 0;
    }
    if (IS(name, nlen, "grpc-timeout")) {
        st->tmo.len = 0;
        rc = buf_put(&st->tmo, value, vlen);
    } else if (IS(name, nlen, "content-type") || IS(name, nlen, "te") || IS(name, nlen, "user-agent")
               || IS(name, nlen, "grpc-accept-encoding") || IS(name, nlen, "accept-encoding")) {
        return 0;
    } else {
        rc = buf_put(&st->hdr, name, nlen) || buf_put(&st->hdr, "", 1) || buf_put(&st->hdr, value, vlen)
             || buf_put(&st->hdr, "", 1);
    }
    return rc ? NGHTTP2_ERR_CALLBACK_FAILURE : 0;
}

static int on_frame_recv(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
    h2conn *c = ud;
    h2stream *st;
    int32_t sid = f->hd.stream_id;
    if (f->hd.type == NGHTTP2_SETTINGS && !(f->hd.flags & NGHTTP2_FLAG_ACK) && !c->settings_seen) {
        c->settings_seen = 1;  /* the client's preface and first SETTINGS: its handshake is done */
        return ev_put(c, 'S', 0, NULL, 0) ? NGHTTP2_ERR_CALLBACK_FAILURE : 0;
    }
    if (f->hd.type != NGHTTP2_HEADERS && f->hd.type != NGHTTP2_DATA) return 0;
    st = nghttp2_session_get_stream_user_data(s, sid);
    if (!st) return 0;
    if (f->hd.type == NGHTTP2_HEADERS && f->headers.cat == NGHTTP2_HCAT_REQUEST && !st->request_seen) {
        buf_t rec = {0};
        int bad;
        st->request_seen = 1;
        bad = buf_put(&rec, st->path.p, st->path.len) || buf_put(&rec, "", 1)
              || buf_put(&rec, st->tmo.p, st->tmo.len) || buf_put(&rec, "", 1)
              || buf_put(&rec, st->hdr.p, st->hdr.len);
        if (!bad) bad = ev_put(c, 'H', sid, rec.p, rec.len);
        buf_free(&rec); buf_free(&st->hdr); buf_free(&st->path); buf_free(&st->tmo);
        if (bad) return NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    if (f->hd.flags & NGHTTP2_FLAG_END_STREAM) {
        if (ev_put(c, 'E', sid, NULL, 0)) return NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    return 0;
}

static int on_data_chunk(nghttp2_session *s, uint8_t flags, int32_t sid, const uint8_t *data, size_t len,
                         void *ud) {
    h2conn *c = ud;
    h2stream *st = nghttp2_session_get_stream_user_data(s, sid);
    /* the stream window is given back at once; the connection's when Python hands the message on */
    nghttp2_session_consume_stream(s, sid, len);
    if (!st || !st->request_seen) {
        nghttp2_session_consume_connection(s, len);
        return 0;
    }
    return ev_put(c, 'D', sid, data, len) ? NGHTTP2_ERR_CALLBACK_FAILURE : 0;
}

static int on_stream_close(nghttp2_session *s, int32_t sid, uint32_t code, void *ud) {
    h2conn *c = ud;
    h2stream *st = nghttp2_session_get_stream_user_data(s, sid);
    unsigned char b[4];
    if (!st) return 0;
    nghttp2_session_set_stream_user_data(s, sid, NULL);
    if (st->request_seen) {
        b[0] = (code >> 24) & 0xff; b[1] = (code >> 16) & 0xff; b[2] = (code >> 8) & 0xff; b[3] = code & 0xff;
        ev_put(c, 'C', sid, b, 4);
    }
    stream_free(c, st);
    return 0;
}

static int submit_trailers(nghttp2_session *s, int32_t sid, h2stream *st) {
    nghttp2_nv nv[2];
    size_t sl = strnlen(st->trl.p, st->trl.len);
    size_t ml = st->trl.len > sl + 1 ? st->trl.len - sl - 1 : 0;
    nv[0].name = (uint8_t *)"grpc-status"; nv[0].namelen = 11;
    nv[0].value = (uint8_t *)st->trl.p; nv[0].valuelen = sl; nv[0].flags = NGHTTP2_NV_FLAG_NONE;
    nv[1].name = (uint8_t *)"grpc-message"; nv[1].namelen = 12;
    nv[1].value = (uint8_t *)st->trl.p + sl + 1; nv[1].valuelen = ml; nv[1].flags = NGHTTP2_NV_FLAG_NONE;
    return nghttp2_submit_trailer(s, sid, nv, ml ? 2 : 1);
}

static ssize_t read_out(nghttp2_session *s, int32_t sid, uint8_t *buf, size_t length, uint32_t *flags,
                        nghttp2_data_source *src, void *ud) {
    h2conn *c = ud;
    h2stream *st = src->ptr;
    size_t avail = st->out.len - st->off, n = avail < length ? avail : length;
    if (n) {
        memcpy(buf, st->out.p + st->off, n);
        st->off += n;
    }
    if (st->off == st->out.len) {
        st->off = st->out.len = 0;
        if (st->out.cap > 65536) buf_free(&st->out);
        if (st->want_w) { st->want_w = 0; ev_put(c, 'W', sid, NULL, 0); }
        if (st->eof) {
            *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
            if (submit_trailers(s, sid, st)) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
            return (ssize_t)n;
        }
        if (!n) { st->deferred = 1; return NGHTTP2_ERR_DEFERRED; }
    }
    return (ssize_t)n;
}

static ssize_t send_noop(nghttp2_session *s, const uint8_t *d, size_t n, int flags, void *ud) {
    return NGHTTP2_ERR_CALLBACK_FAILURE;  /* mem_send only */
}

h2conn *h2_new(uint32_t max_streams, uint32_t max_header_list, uint32_t stream_window, uint32_t conn_window) {
    nghttp2_session_callbacks *cb;
    nghttp2_option *opt;
    nghttp2_settings_entry iv[3];
    h2conn *c = calloc(1, sizeof(*c));
    int rv;
    if (!c) return NULL;
    c->max_header_list = max_header_list;
    if (nghttp2_session_callbacks_new(&cb)) { free(c); return NULL; }
    nghttp2_session_callbacks_set_send_callback(cb, send_noop);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cb, on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cb, on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cb, on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, on_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, on_stream_close);
    if (nghttp2_option_new(&opt)) { nghttp2_session_callbacks_del(cb); free(c); return NULL; }
    nghttp2_option_set_no_auto_window_update(opt, 1);
    nghttp2_option_set_max_deflate_dynamic_table_size(opt, 4096);
    rv = nghttp2_session_server_new2(&c->s, cb, c, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cb);
    if (rv) { free(c); return NULL; }
    iv[0].settings_id = NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS; iv[0].value = max_streams;
    iv[1].settings_id = NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE; iv[1].value = max_header_list;
    iv[2].settings_id = NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE; iv[2].value = stream_window;
    if (nghttp2_submit_settings(c->s, NGHTTP2_FLAG_NONE, iv, 3)
        || nghttp2_session_set_local_window_size(c->s, NGHTTP2_FLAG_NONE, 0, (int32_t)conn_window)) {
        nghttp2_session_del(c->s); free(c); return NULL;
    }
    return c;
}

void h2_free(h2conn *c) {
    if (!c) return;
    nghttp2_session_del(c->s);
    while (c->streams) stream_free(c, c->streams);
    buf_free(&c->ev); buf_free(&c->wr);
    free(c);
}

int h2_recv(h2conn *c, const char *data, size_t len, char **ev, size_t *evlen) {
    ssize_t rv;
    c->ev.len = 0;
    rv = nghttp2_session_mem_recv(c->s, (const uint8_t *)data, len);
    *ev = c->ev.p; *evlen = c->ev.len;
    if (c->oom) return NGHTTP2_ERR_NOMEM;
    return rv < 0 ? (int)rv : 0;
}

int h2_send_out(h2conn *c, char **out, size_t *outlen, char **ev, size_t *evlen) {
    const uint8_t *d;
    ssize_t n;
    c->wr.len = 0;
    c->ev.len = 0;  /* 'W' records the data sources write while sending */
    for (;;) {
        n = nghttp2_session_mem_send(c->s, &d);
        if (n < 0) { *outlen = 0; *evlen = 0; return (int)n; }
        if (n == 0) break;
        if (buf_put(&c->wr, d, (size_t)n)) { *outlen = 0; *evlen = 0; return NGHTTP2_ERR_NOMEM; }
    }
    *out = c->wr.p; *outlen = c->wr.len;
    *ev = c->ev.p; *evlen = c->ev.len;
    return c->oom ? NGHTTP2_ERR_NOMEM : 0;
}

int h2_reply(h2conn *c, int32_t sid, const char *msg, size_t len, int has_msg, const char *trailer, size_t tlen,
             size_t mark) {
    h2stream *st = nghttp2_session_get_stream_user_data(c->s, sid);
    int rv;
    if (!st || st->eof) return -1;
    if (has_msg) {
        unsigned char h[5];
        h[0] = 0; h[1] = (len >> 24) & 0xff; h[2] = (len >> 16) & 0xff; h[3] = (len >> 8) & 0xff; h[4] = len & 0xff;
        if (buf_put(&st->out, h, 5) || buf_put(&st->out, msg, len)) return NGHTTP2_ERR_NOMEM;
    }
    if (trailer) {
        st->eof = 1;
        if (buf_put(&st->trl, trailer, tlen)) return NGHTTP2_ERR_NOMEM;
    }
    if (!st->replied) {
        nghttp2_nv nv[4];
        nghttp2_data_provider dp;
        st->replied = 1;
        nv[0].name = (uint8_t *)":status"; nv[0].namelen = 7; nv[0].value = (uint8_t *)"200"; nv[0].valuelen = 3;
        nv[1].name = (uint8_t *)"content-type"; nv[1].namelen = 12;
        nv[1].value = (uint8_t *)"application/grpc"; nv[1].valuelen = 16;
        nv[0].flags = nv[1].flags = NGHTTP2_NV_FLAG_NONE;
        if (trailer && !st->out.len) {  /* Trailers-Only */
            size_t sl = strnlen(st->trl.p, st->trl.len);
            size_t ml = st->trl.len > sl + 1 ? st->trl.len - sl - 1 : 0;
            nv[2].name = (uint8_t *)"grpc-status"; nv[2].namelen = 11;
            nv[2].value = (uint8_t *)st->trl.p; nv[2].valuelen = sl; nv[2].flags = NGHTTP2_NV_FLAG_NONE;
            nv[3].name = (uint8_t *)"grpc-message"; nv[3].namelen = 12;
            nv[3].value = (uint8_t *)st->trl.p + sl + 1; nv[3].valuelen = ml; nv[3].flags = NGHTTP2_NV_FLAG_NONE;
            return nghttp2_submit_response(c->s, sid, nv, ml ? 4 : 3, NULL);
        }
        dp.source.ptr = st;
        dp.read_callback = read_out;
        return nghttp2_submit_response(c->s, sid, nv, 2, &dp);
    }
    if (st->deferred) {
        st->deferred = 0;
        rv = nghttp2_session_resume_data(c->s, sid);
        if (rv) return rv;
    }
    if (mark && st->out.len - st->off > mark) { st->want_w = 1; return 1; }
    return 0;
}

int h2_reset(h2conn *c, int32_t sid, uint32_t code) {
    return nghttp2_submit_rst_stream(c->s, NGHTTP2_FLAG_NONE, sid, code);
}

int h2_consume(h2conn *c, size_t n) { return nghttp2_session_consume_connection(c->s, n); }

int h2_goaway(h2conn *c) {
    return nghttp2_submit_goaway(c->s, NGHTTP2_FLAG_NONE, nghttp2_session_get_last_proc_stream_id(c->s),
                                 NGHTTP2_NO_ERROR, NULL, 0);
}

int h2_want(h2conn *c) { return nghttp2_session_want_read(c->s) | (nghttp2_session_want_write(c->s) << 1); }
"""

HEADER = "/usr/include/nghttp2/nghttp2.h"


def have_nghttp2() -> bool:
    """The development header is there (Debian: libnghttp2-dev)."""
    inc = [d for d in os.environ.get("CPATH", "").split(":") if d] + ["/usr/include", "/usr/local/include"]
    return any(os.path.exists(os.path.join(d, "nghttp2", "nghttp2.h")) for d in inc)


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("rmqfast.grpcfront._h2", SOURCE, libraries=["nghttp2"], extra_compile_args=["-O2"])


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    if not have_nghttp2():
        sys.exit("nghttp2/nghttp2.h not found: install libnghttp2-dev (Debian) to build rmqfast.grpcfront._h2")
    ffibuilder.compile(tmpdir=os.path.join(root, "build", "cffi"), target=os.path.join(here, "_h2.*"))
