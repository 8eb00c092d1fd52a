# Included by _speedups.pyx. The header walk, the C twin of rmqfast/codec/_header_py.py.
#
# One reading of a header.  What the scanner decides from a header (code, flag, opaque, topic,
# properties) must be what the broker reads.  The brokers decode JSON headers with fastjson, which
# keeps the first of duplicate keys, decodes escapes, matches RemotingCommand fields ignoring case,
# '_' and '-', and also accepts single quotes, unquoted keys and \x escapes; they decode ROCKETMQ
# binary headers into a HashMap (the last duplicate wins).  The walk does not guess which reading
# applies: it accepts only headers whose reading is unambiguous and refuses (EV_ERROR: the relay
# closes the connection and logs why) everything else:
#   - JSON that is not strict RFC 8259 (single quotes, unquoted keys, comments, NaN, leading zeros,
#     escapes other than \" \\ \/ \b \f \n \r \t \uXXXX, lone surrogates, raw control characters
#     in strings, invalid or overlong UTF-8, nesting deeper than MAX_JSON_DEPTH);
#   - a top-level key with an escape, or spelled like code/flag/opaque/extFields in another case or
#     with '_' / '-' (or an "is" prefix), or any of those four twice;
#   - an extFields key with an escape, or b/topic/i/properties/m/batch twice, or one of them not a string;
#   - an escaped topic in a send or pull (RocketMQ topics are [%|a-zA-Z0-9_-]; no encoder escapes them);
#   - a binary header whose lengths do not add up exactly, with a key length Java reads as negative,
#     or with b/topic/i/properties/m/batch twice.
# No RocketMQ client (Java, Go, C++) produces any of these.



# MAX_JSON_DEPTH_C: tables.pxi

# Error codes of the header walk; messages live in _ERRORS (same text as the Python twin).  A
# cpdef enum, so that the twin-constant test sees the codes from Python too.
cpdef enum HeaderErrorCode:
    E_OK = 0
    E_UNTERMINATED_STRING
    E_VALUE_EXPECTED
    E_UNTERMINATED_NESTED
    E_UNEXPECTED_CHAR
    E_INT_RANGE
    E_INT_EXPECTED
    E_NOT_OBJECT
    E_NO_CODE
    E_KEY_EXPECTED
    E_COLON_EXPECTED
    E_COMMA_EXPECTED
    E_TRAILING
    E_BIN_SHORT
    E_BIN_REMARK
    E_BIN_EXT
    E_BIN_KEY_TRUNC
    E_BIN_KEY
    E_BIN_VALUE
    E_BAD_ESCAPE
    E_CONTROL_CHAR
    E_BAD_UTF8
    E_BAD_NUMBER
    E_TOO_DEEP
    E_KEY_ESCAPED
    E_KEY_VARIANT
    E_DUP_KEY
    E_EXT_KEY_ESCAPED
    E_EXT_DUP_KEY
    E_EXT_NOT_STRING
    E_BIN_TRAILING
    E_BIN_DUP_KEY
    E_TOPIC_ESCAPED

for _code in HeaderErrorCode:     # the codes as module constants too, like the Python twin's
    globals()[_code.name] = int(_code)
del _code

_ERRORS = (
    "",
    "unterminated string",
    "value expected",
    "unterminated object or array",
    "unexpected character",
    "integer out of range",
    "integer expected",
    "header is not a JSON object",
    "no code field",
    "key expected",
    "':' expected",
    "',' or '}' expected",
    "trailing data after the header object",
    "binary header shorter than 21 bytes",
    "remark length out of bounds",
    "extFields length out of bounds",
    "extFields key length truncated",
    "extFields key out of bounds",
    "extFields value out of bounds",
    "escape other than \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX (or a lone surrogate)",
    "raw control character in a string",
    "invalid UTF-8",
    "malformed number",
    "nested deeper than 32 levels",
    "escaped key (fastjson would decode it; no client escapes keys)",
    "key spelled like code/flag/opaque/extFields in another case or with '_'/'-' (fastjson would match it)",
    "duplicate code/flag/opaque/extFields key (fastjson keeps the first)",
    "escaped extFields key",
    "duplicate extFields key b/topic/i/properties/m/batch",
    "extFields b/topic/i/properties/m/batch is not a string",
    "binary header has bytes after extFields",
    "duplicate binary extFields key b/topic/i/properties/m/batch",
    "escaped topic in a send or pull",
)

# Keys the walk acts on: bits for duplicate detection.
cdef enum:
    K_CODE = 1
    K_FLAG = 2
    K_OPAQUE = 4
    K_EXT = 8
    X_B = 1
    X_TOPIC = 2
    X_I = 4
    X_PROPS = 8
    X_M = 16             # SendMessageRequestHeaderV2.m (310, 320): batch
    X_BATCH = 32         # SendMessageRequestHeader.batch (10)
    S_ESC = 1            # the string had an escape


cdef struct HeaderInfo:
    int32_t code
    int32_t flag
    int32_t opaque
    Py_ssize_t b_start       # extFields.b (the topic of V2 sends); -1: absent
    Py_ssize_t b_len
    bint b_esc
    Py_ssize_t t_start       # extFields.topic (V1 sends, pulls); -1: absent
    Py_ssize_t t_len
    bint t_esc
    Py_ssize_t i_start       # extFields.i (properties of V2 sends); -1: absent
    Py_ssize_t i_len
    bint i_esc               # JSON-escaped (separators appear as \u0001 / \u0002)
    Py_ssize_t pr_start      # extFields.properties (V1 sends); -1: absent
    Py_ssize_t pr_len
    bint pr_esc
    bint m_true              # extFields.m reads true (Boolean.parseBoolean: "true" in any case)
    bint batch_true          # extFields.batch reads true


cdef inline void header_info_clear(HeaderInfo* info) noexcept nogil:
    info.code = 0
    info.flag = 0
    info.opaque = 0
    info.b_start = info.t_start = info.i_start = info.pr_start = -1
    info.b_len = info.t_len = info.i_len = info.pr_len = 0
    info.b_esc = info.t_esc = info.i_esc = info.pr_esc = False
    info.m_true = info.batch_true = False


cdef inline bint is_ws(uint8_t c) noexcept nogil:
    return c == 32 or c == 9 or c == 13 or c == 10


cdef inline Py_ssize_t skip_ws(const uint8_t* h, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and h[i] <= 32 and is_ws(h[i]):    # one compare for the usual non-space byte
        i += 1
    return i


cdef int8_t HEXVAL[256]        # value of a hex digit, -1 for other bytes


cdef void _init_hexval() noexcept:
    cdef int c
    for c in range(256):
        HEXVAL[c] = c - 48 if 48 <= c <= 57 else c - 87 if 97 <= c <= 102 else c - 55 if 65 <= c <= 70 else -1


_init_hexval()


cdef inline int32_t hex4(const uint8_t* p) noexcept nogil:
    """The value of 4 hex digits, -1 if they are not."""
    cdef int32_t a = HEXVAL[p[0]], b = HEXVAL[p[1]], c = HEXVAL[p[2]], d = HEXVAL[p[3]]
    if (a | b | c | d) < 0:
        return -1
    return (a << 12) | (b << 8) | (c << 4) | d


# Bytes a string may hold as they are (not '"', '\\', a control character or non-ASCII): the
# string walk's fast path is one table lookup per byte.
cdef uint8_t STR_PLAIN[256]


cdef void _init_str_plain() noexcept:
    cdef int c
    for c in range(256):
        STR_PLAIN[c] = 1 if 0x20 <= c < 0x80 and c != 34 and c != 92 else 0


_init_str_plain()


cdef inline bint word_has_special(const uint8_t* p) noexcept nogil:
    """Whether 8 bytes hold a '"', a '\\', a control character or a non-ASCII byte (SWAR)."""
    cdef uint64_t x, q, b
    memcpy(&x, p, 8)
    q = x ^ 0x2222222222222222ULL
    b = x ^ 0x5C5C5C5C5C5C5C5CULL
    return (((q - 0x0101010101010101ULL) & ~q) | ((b - 0x0101010101010101ULL) & ~b)
            | ((x - 0x2020202020202020ULL) & ~x) | x) & 0x8080808080808080ULL != 0


cdef extern from *:
    """
    /* Offset of the first byte of 8 that word_special_mask flagged (mask != 0).  The mask's
     * lowest flagged byte is exact (a borrow only runs upwards from a byte that is special). */
    static inline int rmq_first_flagged(uint64_t mask) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && defined(__GNUC__)
        return __builtin_ctzll(mask) >> 3;
    #else
        int k = 0;
        while (!(mask & 0x80ULL)) { mask >>= 8; k++; }
        return k;
    #endif
    }
    /* 1 when the first-flagged shortcut applies (loads are little-endian), else 0. */
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    #define RMQ_SWAR_LE 1
    #else
    #define RMQ_SWAR_LE 0
    #endif
    """
    int rmq_first_flagged(uint64_t mask) nogil
    const int RMQ_SWAR_LE


cdef inline uint64_t word_special_mask(const uint8_t* p) noexcept nogil:
    """word_has_special's mask: 0x80 set in (at least) the first special byte of 8, none below it."""
    cdef uint64_t x, q, b
    memcpy(&x, p, 8)
    q = x ^ 0x2222222222222222ULL
    b = x ^ 0x5C5C5C5C5C5C5C5CULL
    return (((q - 0x0101010101010101ULL) & ~q) | ((b - 0x0101010101010101ULL) & ~b)
            | ((x - 0x2020202020202020ULL) & ~x) | x) & 0x8080808080808080ULL


# The special-byte bitmap of a header: bit k of word k / 64 is set when byte k is '"', '\\', a
# control character or non-ASCII, and every bit from the header's end to the end of its word (a
# word of set bits when the end falls on a word boundary), so a search for the next special byte
# always stops by the end.  Built once per header with SSE2 (16 bytes in a few instructions) and
# read by every string of the walk: finding a string's end is then a bit search, not a byte loop.
# Headers up to BITMAP_MAX_HEADER bytes (nearly all: a Java send's is ~350) get one on the stack;
# longer ones are walked with the eight-byte loop instead (both are tested alike).
cdef enum:
    BITMAP_WORDS = 64
    BITMAP_MAX_HEADER = BITMAP_WORDS * 64 - 1


cdef extern from *:
    """
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* 64 flags of h[0:64]: '"', '\\', < 0x20 or >= 0x80 (a signed compare with 0x20 catches both). */
    static inline uint64_t rmq_special64(const uint8_t* h) {
    #if defined(__SSE2__)
        const __m128i q = _mm_set1_epi8(0x22), b = _mm_set1_epi8(0x5C), sp = _mm_set1_epi8(0x20);
        uint64_t m = 0;
        int k;
        for (k = 0; k < 4; k++) {
            __m128i x = _mm_loadu_si128((const __m128i*)(h + 16 * k));
            __m128i s = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, q), _mm_cmpeq_epi8(x, b)),
                                     _mm_cmplt_epi8(x, sp));
            m |= (uint64_t)(uint16_t)_mm_movemask_epi8(s) << (16 * k);
        }
        return m;
    #else
        uint64_t m = 0;
        int k;
        for (k = 0; k < 64; k++) {
            uint8_t c = h[k];
            if (c == 0x22 || c == 0x5C || c < 0x20 || c >= 0x80) m |= 1ULL << k;
        }
        return m;
    #endif
    }
    /* The bitmap of h[0:n] into bm[0 .. n / 64] (n / 64 + 1 words). */
    static inline void rmq_special_bitmap(const uint8_t* h, Py_ssize_t n, uint64_t* bm) {
        uint8_t tail[64];
        Py_ssize_t i = 0, rest;
        for (; i + 64 <= n; i += 64)
            bm[i >> 6] = rmq_special64(h + i);
        rest = n - i;  /* 0..63: zero bytes after it are control characters, so flagged */
        memset(tail, 0, sizeof tail);
        memcpy(tail, h + i, (size_t)rest);
        bm[i >> 6] = rmq_special64(tail);
    }
    /* The first special byte at or after i (i <= n): at most n. */
    static inline Py_ssize_t rmq_next_special(const uint64_t* bm, Py_ssize_t i) {
        Py_ssize_t w = i >> 6;
        uint64_t m = bm[w] & (~0ULL << (i & 63));
        while (!m)
            m = bm[++w];
    #if defined(__GNUC__)
        return (w << 6) + __builtin_ctzll(m);
    #else
        {
            int k = 0;
            while (!(m & 1)) { m >>= 1; k++; }
            return (w << 6) + k;
        }
    #endif
    }
    """
    void rmq_special_bitmap(const uint8_t* h, Py_ssize_t n, uint64_t* bm) nogil
    Py_ssize_t rmq_next_special(const uint64_t* bm, Py_ssize_t i) nogil


# Return convention of the walkers: new index >= 0, or -(error code).
cdef inline Py_ssize_t scan_string(const uint64_t* bm, const uint8_t* h, Py_ssize_t i, Py_ssize_t n,
                                   int* flags) noexcept nogil:
    """``h[i]`` is the opening quote: strict JSON string, strict UTF-8.  Inline fast path for
    strings of plain ASCII (nearly all of them); the rest goes on in scan_string_rest.  ``bm``:
    the header's special-byte bitmap, or NULL (a long header: eight bytes at a time)."""
    cdef uint64_t mask
    i += 1
    if bm != NULL:
        i = rmq_next_special(bm, i)
    elif RMQ_SWAR_LE:
        # eight bytes at a time; the first special byte of a word found from its mask
        while i + 8 <= n:
            mask = word_special_mask(h + i)
            if mask:
                i += rmq_first_flagged(mask)
                break
            i += 8
        else:
            while i < n and STR_PLAIN[h[i]]:
                i += 1
    else:
        while i + 8 <= n and not word_has_special(h + i):
            i += 8
        while i < n and STR_PLAIN[h[i]]:
            i += 1
    if i < n and h[i] == 34:
        flags[0] = 0
        return i + 1
    return scan_string_rest(bm, h, i, n, flags)


cdef Py_ssize_t scan_string_rest(const uint64_t* bm, const uint8_t* h, Py_ssize_t i, Py_ssize_t n,
                                 int* flags) noexcept nogil:
    """scan_string from ``h[i]``, a byte that is not plain ASCII."""
    cdef uint8_t c
    cdef int32_t u, lo
    cdef int f = 0, k
    while True:
        if bm != NULL:    # up to the next special byte (at most n)
            i = rmq_next_special(bm, i)
        else:             # eight plain bytes at a time, then byte by byte up to the next special one
            while i + 8 <= n and not word_has_special(h + i):
                i += 8
            while i < n and STR_PLAIN[h[i]]:
                i += 1
        if i >= n:
            break
        c = h[i]
        if c == 34:
            flags[0] = f
            return i + 1
        if c == 92:
            f |= S_ESC
            if i + 1 >= n:
                return -E_UNTERMINATED_STRING
            c = h[i + 1]
            if c == 117:  # \uXXXX, surrogates only in pairs
                if i + 6 > n:
                    return -E_BAD_ESCAPE
                if h[i + 2] == 48 and h[i + 3] == 48 and h[i + 4] == 48 and HEXVAL[h[i + 5]] >= 0:
                    i += 6    # \u000X: the property separators \u0001 \u0002 of every send
                    continue
                u = hex4(h + i + 2)
                if u < 0 or 0xDC00 <= u <= 0xDFFF:
                    return -E_BAD_ESCAPE
                i += 6
                if 0xD800 <= u <= 0xDBFF:
                    if i + 6 > n or h[i] != 92 or h[i + 1] != 117:
                        return -E_BAD_ESCAPE
                    lo = hex4(h + i + 2)
                    if lo < 0xDC00 or lo > 0xDFFF:
                        return -E_BAD_ESCAPE
                    i += 6
                continue
            if c == 34 or c == 92 or c == 47 or c == 98 or c == 102 or c == 110 or c == 114 or c == 116:
                i += 2
                continue
            return -E_BAD_ESCAPE
        if c < 0x20:
            return -E_CONTROL_CHAR
        if c < 0x80:
            i += 1
            continue
        k = utf8_sequence(h, i, n)
        if k < 0:
            return k
        i += k
    return -E_UNTERMINATED_STRING


cdef inline int utf8_sequence(const uint8_t* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """Length of the strict UTF-8 sequence (no overlong forms, no surrogates, at most U+10FFFF)
    starting at the non-ASCII byte ``p[i]`` of ``p[:n]``; -(error code) if there is none."""
    cdef uint8_t c = p[i]
    cdef int need, k
    cdef uint32_t cp
    if 0xC2 <= c <= 0xDF:
        need = 1
        cp = c & 0x1F
    elif 0xE0 <= c <= 0xEF:
        need = 2
        cp = c & 0x0F
    elif 0xF0 <= c <= 0xF4:
        need = 3
        cp = c & 0x07
    else:
        return -E_BAD_UTF8
    if i + need >= n:
        return -E_UNTERMINATED_STRING
    for k in range(1, need + 1):
        if (p[i + k] & 0xC0) != 0x80:
            return -E_BAD_UTF8
        cp = (cp << 6) | (p[i + k] & 0x3F)
    if (need == 2 and (cp < 0x800 or 0xD800 <= cp <= 0xDFFF)) or (need == 3 and (cp < 0x10000 or cp > 0x10FFFF)):
        return -E_BAD_UTF8
    return need + 1


cdef bint utf8_valid(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """Strict UTF-8 through and through."""
    cdef Py_ssize_t i = 0
    cdef int k
    while i < n:
        if p[i] < 0x80:
            i += 1
            continue
        k = utf8_sequence(p, i, n)
        if k < 0:
            return False
        i += k
    return True


cdef Py_ssize_t scan_number(const uint8_t* h, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?"""
    cdef Py_ssize_t s
    if i < n and h[i] == 45:
        i += 1
    if i < n and h[i] == 48:
        i += 1
    elif i < n and 49 <= h[i] <= 57:
        while i < n and 48 <= h[i] <= 57:
            i += 1
    else:
        return -E_BAD_NUMBER
    if i < n and h[i] == 46:
        i += 1
        s = i
        while i < n and 48 <= h[i] <= 57:
            i += 1
        if i == s:
            return -E_BAD_NUMBER
    if i < n and (h[i] == 101 or h[i] == 69):
        i += 1
        if i < n and (h[i] == 43 or h[i] == 45):
            i += 1
        s = i
        while i < n and 48 <= h[i] <= 57:
            i += 1
        if i == s:
            return -E_BAD_NUMBER
    return i


cdef inline Py_ssize_t scan_literal(const uint8_t* h, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    if n - i >= 4 and (memcmp(h + i, b"true", 4) == 0 or memcmp(h + i, b"null", 4) == 0):
        return i + 4
    if n - i >= 5 and memcmp(h + i, b"false", 5) == 0:
        return i + 5
    return -E_UNEXPECTED_CHAR


cdef inline Py_ssize_t scan_member_key(const uint64_t* bm, const uint8_t* h, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """A key of a nested object, its ':' and the whitespace after it."""
    cdef int f
    if i >= n or h[i] != 34:
        return -E_KEY_EXPECTED
    i = scan_string(bm, h, i, n, &f)
    if i < 0:
        return i
    i = skip_ws(h, i, n)
    if i >= n or h[i] != 58:
        return -E_COLON_EXPECTED
    return skip_ws(h, i + 1, n)


cdef Py_ssize_t skip_value(const uint64_t* bm, const uint8_t* h, Py_ssize_t i, Py_ssize_t n, int depth0) noexcept nogil:
    """Validate and skip one strict JSON value inside containers ``depth0`` deep."""
    cdef uint64_t objects = 0      # bit d: nesting level d is an object (else an array)
    cdef int depth = 0, f
    cdef uint8_t c
    cdef bint is_obj
    while True:
        # a value starts at i
        if i >= n:
            return -E_VALUE_EXPECTED
        c = h[i]
        if c == 123 or c == 91:
            if depth0 + depth + 1 > MAX_JSON_DEPTH_C:
                return -E_TOO_DEEP
            if c == 123:
                objects |= (<uint64_t>1) << depth
            else:
                objects &= ~((<uint64_t>1) << depth)
            depth += 1
            i = skip_ws(h, i + 1, n)
            if i < n and h[i] == c + 2:        # '{' + 2 == '}', '[' + 2 == ']'
                i += 1
                depth -= 1
            elif c == 123:
                i = scan_member_key(bm, h, i, n)
                if i < 0:
                    return i
                continue
            else:
                continue
        elif c == 34:
            i = scan_string(bm, h, i, n, &f)
        elif c == 45 or 48 <= c <= 57:
            i = scan_number(h, i, n)
        elif c == 116 or c == 102 or c == 110:
            i = scan_literal(h, i, n)
        else:
            return -E_UNEXPECTED_CHAR
        if i < 0:
            return i
        # after a value: separators and closing brackets
        while True:
            if depth == 0:
                return i
            i = skip_ws(h, i, n)
            if i >= n:
                return -E_UNTERMINATED_NESTED
            c = h[i]
            is_obj = (objects >> (depth - 1)) & 1
            if c == 44:
                i = skip_ws(h, i + 1, n)
                if is_obj:
                    i = scan_member_key(bm, h, i, n)
                    if i < 0:
                        return i
                break
            if (is_obj and c == 125) or (not is_obj and c == 93):
                i += 1
                depth -= 1
                continue
            return -E_COMMA_EXPECTED


cdef inline Py_ssize_t parse_int(const uint8_t* h, Py_ssize_t i, Py_ssize_t n, int32_t* out) noexcept nogil:
    """A strict JSON integer in int32 range."""
    cdef bint neg = False
    cdef int64_t v = 0
    if i < n and h[i] == 45:
        neg = True
        i += 1
    if i < n and h[i] == 48:
        i += 1
    elif i < n and 49 <= h[i] <= 57:
        while i < n and <uint8_t>(h[i] - 48) < 10:
            v = v * 10 + (h[i] - 48)
            if v > 2147483648LL:
                return -E_INT_RANGE
            i += 1
    else:
        return -E_INT_EXPECTED
    if i < n and (h[i] == 46 or h[i] == 101 or h[i] == 69 or 48 <= h[i] <= 57):
        return -E_INT_EXPECTED
    if neg:
        v = -v
    if v > 0x7FFFFFFF:
        return -E_INT_RANGE
    out[0] = <int32_t>v
    return i


cdef inline bint key_is(const uint8_t* h, Py_ssize_t ks, Py_ssize_t klen, const char* lit, Py_ssize_t litlen) noexcept nogil:
    return klen == litlen and memcmp(h + ks, lit, litlen) == 0


cdef inline bint is_field_name(const uint8_t* p, Py_ssize_t m) noexcept nogil:
    """A lower-cased RemotingCommand field the walk acts on."""
    return (m == 4 and (memcmp(p, b"code", 4) == 0 or memcmp(p, b"flag", 4) == 0)) or \
        (m == 6 and memcmp(p, b"opaque", 6) == 0) or (m == 9 and memcmp(p, b"extfields", 9) == 0)


cdef int header_key(const uint8_t* k, Py_ssize_t n) noexcept nogil:
    """K_* of a top-level key; 0 for other keys; -1 for a spelling fastjson's smart match could
    read as one of them (another case, '_' or '-' inserted, an "is" prefix)."""
    cdef uint8_t low[16]
    cdef Py_ssize_t i, m = 0
    cdef uint8_t c
    if n == 4 and memcmp(k, b"code", 4) == 0:
        return K_CODE
    if n == 4 and memcmp(k, b"flag", 4) == 0:
        return K_FLAG
    if n == 6 and memcmp(k, b"opaque", 6) == 0:
        return K_OPAQUE
    if n == 9 and memcmp(k, b"extFields", 9) == 0:
        return K_EXT
    # A spelling of one of them starts (after '_' / '-') with c, f, o, e or i ("is"), in either
    # case: other keys (language, version, serializeTypeCurrentRPC, remark) end here.
    i = 0
    while i < n and (k[i] == 95 or k[i] == 45):
        i += 1
    if i == n:
        return 0
    c = k[i] | 32
    if c != 99 and c != 102 and c != 111 and c != 101 and c != 105:
        return 0
    for i in range(n):
        c = k[i]
        if c == 95 or c == 45:
            continue
        if m == 16:
            return 0
        low[m] = c + 32 if 65 <= c <= 90 else c
        m += 1
    if is_field_name(low, m) or (m >= 2 and low[0] == 105 and low[1] == 115 and is_field_name(low + 2, m - 2)):
        return -1
    return 0


cdef inline int ext_key(const uint8_t* k, Py_ssize_t n) noexcept nogil:
    if n == 1:
        if k[0] == 98:
            return X_B
        if k[0] == 105:
            return X_I
        if k[0] == 109:
            return X_M
        return 0
    if n == 5:
        if memcmp(k, b"topic", 5) == 0:
            return X_TOPIC
        if memcmp(k, b"batch", 5) == 0:
            return X_BATCH
        return 0
    if n == 10 and memcmp(k, b"properties", 10) == 0:
        return X_PROPS
    return 0


cdef bint reads_true(const uint8_t* s, Py_ssize_t n, bint esc) noexcept nogil:
    """Whether a header value reads true as Boolean.parseBoolean reads it: "true" ignoring case
    (no character outside ASCII folds to one of its letters), after JSON escapes are decoded."""
    cdef uint8_t buf[24]
    if esc:
        if n > 24:           # every character of "true" takes at most 6 escaped bytes
            return False
        n = json_unescape(s, n, buf)
        s = buf
    return n == 4 and (s[0] | 32) == 116 and (s[1] | 32) == 114 and (s[2] | 32) == 117 and (s[3] | 32) == 101


cdef inline void ext_record(const uint8_t* h, HeaderInfo* info, int k, Py_ssize_t start, Py_ssize_t length,
                            bint esc) noexcept nogil:
    if k == X_M:
        info.m_true = reads_true(h + start, length, esc)
    elif k == X_BATCH:
        info.batch_true = reads_true(h + start, length, esc)
    elif k == X_B:
        info.b_start, info.b_len, info.b_esc = start, length, esc
    elif k == X_TOPIC:
        info.t_start, info.t_len, info.t_esc = start, length, esc
    elif k == X_I:
        info.i_start, info.i_len, info.i_esc = start, length, esc
    elif k == X_PROPS:
        info.pr_start, info.pr_len, info.pr_esc = start, length, esc


cdef Py_ssize_t walk_ext_fields(const uint64_t* bm, const uint8_t* h, Py_ssize_t i, Py_ssize_t n,
                                HeaderInfo* info) noexcept nogil:
    cdef Py_ssize_t ks, klen, vs
    cdef int f, k, seen = 0
    i = skip_ws(h, i + 1, n)
    if i < n and h[i] == 125:
        return i + 1
    while True:
        if i >= n or h[i] != 34:
            return -E_KEY_EXPECTED
        ks = i + 1
        i = scan_string(bm, h, i, n, &f)
        if i < 0:
            return i
        if f & S_ESC:
            return -E_EXT_KEY_ESCAPED
        klen = i - 1 - ks
        k = ext_key(h + ks, klen)
        if k & seen:
            return -E_EXT_DUP_KEY
        seen |= k
        if i + 1 < n and h[i] == 58 and h[i + 1] == 34:
            i += 1           # '":"' as every client writes it: a string value next
        else:
            i = skip_ws(h, i, n)
            if i >= n or h[i] != 58:
                return -E_COLON_EXPECTED
            i = skip_ws(h, i + 1, n)
        if k:
            if i >= n or h[i] != 34:
                return -E_EXT_NOT_STRING
            vs = i + 1
            i = scan_string(bm, h, i, n, &f)
            if i < 0:
                return i
            ext_record(h, info, k, vs, i - 1 - vs, f & S_ESC)
        elif i < n and h[i] == 34:     # most values are strings: skip_value's loop is not needed
            i = scan_string(bm, h, i, n, &f)
            if i < 0:
                return i
        else:
            i = skip_value(bm, h, i, n, 2)
            if i < 0:
                return i
        if i + 1 < n and h[i] == 44 and h[i + 1] == 34:
            i += 1           # ',"': the next key
            continue
        i = skip_ws(h, i, n)
        if i < n and h[i] == 44:
            i = skip_ws(h, i + 1, n)
            continue
        if i < n and h[i] == 125:
            return i + 1
        return -E_COMMA_EXPECTED


cdef int parse_json_header(const uint8_t* h, Py_ssize_t n, HeaderInfo* info) noexcept nogil:
    cdef Py_ssize_t i, ks
    cdef int f, k, seen = 0
    cdef uint64_t bitmap[BITMAP_WORDS]
    cdef const uint64_t* bm = NULL
    if n <= BITMAP_MAX_HEADER:
        rmq_special_bitmap(h, n, bitmap)
        bm = bitmap
    i = skip_ws(h, 0, n)
    if i >= n or h[i] != 123:
        return E_NOT_OBJECT
    i = skip_ws(h, i + 1, n)
    if i < n and h[i] == 125:
        return E_NO_CODE
    while True:
        if i >= n or h[i] != 34:
            return E_KEY_EXPECTED
        ks = i + 1
        i = scan_string(bm, h, i, n, &f)
        if i < 0:
            return <int>(-i)
        if f & S_ESC:
            return E_KEY_ESCAPED
        k = header_key(h + ks, i - 1 - ks)
        if k < 0:
            return E_KEY_VARIANT
        if k & seen:
            return E_DUP_KEY
        seen |= k
        i = skip_ws(h, i, n)
        if i >= n or h[i] != 58:
            return E_COLON_EXPECTED
        i = skip_ws(h, i + 1, n)
        if k == K_CODE:
            i = parse_int(h, i, n, &info.code)
        elif k == K_FLAG:
            i = parse_int(h, i, n, &info.flag)
        elif k == K_OPAQUE:
            i = parse_int(h, i, n, &info.opaque)
        elif k == K_EXT and i < n and h[i] == 123:
            i = walk_ext_fields(bm, h, i, n, info)
        elif i < n and h[i] == 34:
            i = scan_string(bm, h, i, n, &f)
        elif i < n and (<uint8_t>(h[i] - 48) < 10 or h[i] == 45):
            i = scan_number(h, i, n)    # "version": skip_value would read it so, with more steps
        else:
            i = skip_value(bm, h, i, n, 1)
        if i < 0:
            return <int>(-i)
        if i + 1 < n and h[i] == 44 and h[i + 1] == 34:
            i += 1           # ',"': the next key
            continue
        i = skip_ws(h, i, n)
        if i < n and h[i] == 44:
            i = skip_ws(h, i + 1, n)
            continue
        if i < n and h[i] == 125:
            i += 1
            break
        return E_COMMA_EXPECTED
    if skip_ws(h, i, n) != n:
        return E_TRAILING
    if not seen & K_CODE:
        return E_NO_CODE
    return E_OK


cdef int parse_binary_header(const uint8_t* h, Py_ssize_t n, HeaderInfo* info) noexcept nogil:
    """RocketMQSerializable's layout; the extFields region must end exactly at the header's end."""
    cdef Py_ssize_t i, end, klen, ks
    cdef int32_t rlen, elen, vlen
    cdef int k, seen = 0
    if n < 21:
        return E_BIN_SHORT
    info.code = rd_i16(h)
    info.opaque = rd_i32(h + 5)
    info.flag = rd_i32(h + 9)
    rlen = rd_i32(h + 13)
    i = 17
    if rlen < 0 or rlen > n - i - 4:
        return E_BIN_REMARK
    i += rlen
    elen = rd_i32(h + i)
    i += 4
    if elen < 0 or elen > n - i:
        return E_BIN_EXT
    end = i + elen
    if end != n:
        return E_BIN_TRAILING
    while i < end:
        if end - i < 2:
            return E_BIN_KEY_TRUNC
        klen = rd_u16(h + i)
        i += 2
        if klen >= 0x8000 or klen > end - i - 4:   # Java reads the length as a signed short
            return E_BIN_KEY
        ks = i
        i += klen
        vlen = rd_i32(h + i)
        i += 4
        if vlen < 0 or vlen > end - i:
            return E_BIN_VALUE
        k = ext_key(h + ks, klen)
        if k & seen:
            return E_BIN_DUP_KEY
        seen |= k
        if k and vlen > 0:       # Java reads an empty value as null: absent
            if not utf8_valid(h + i, vlen):   # Java would read U+FFFD where the walk sees bytes
                return E_BAD_UTF8
            ext_record(h, info, k, i, vlen, False)
        i += vlen
    return E_OK


cdef uint64_t count_batch(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint64_t count = 0
    cdef Py_ssize_t i = 0
    cdef int32_t size
    while n - i >= 4:
        size = rd_i32(p + i)
        if size <= 0:
            break
        count += 1
        i += size
    return count


# Message properties: "k\x01v\x02k\x01v..." (MessageDecoder.string2messageProperties).

cdef Py_ssize_t json_unescape(const uint8_t* s, Py_ssize_t n, uint8_t* out) noexcept nogil:
    """Decode the contents of a JSON string the walk accepted into UTF-8; the decoded length."""
    cdef Py_ssize_t i = 0, o = 0
    cdef uint32_t u
    cdef uint8_t c
    while i < n:
        c = s[i]
        if c != 92:
            out[o] = c
            o += 1
            i += 1
            continue
        c = s[i + 1]
        i += 2
        if c == 117:
            u = <uint32_t>hex4(s + i)
            i += 4
            if 0xD800 <= u <= 0xDBFF:
                u = 0x10000 + ((u - 0xD800) << 10) + (<uint32_t>hex4(s + i + 2) - 0xDC00)
                i += 6
            if u < 0x80:
                out[o] = <uint8_t>u
                o += 1
            elif u < 0x800:
                out[o] = <uint8_t>(0xC0 | (u >> 6))
                out[o + 1] = <uint8_t>(0x80 | (u & 0x3F))
                o += 2
            elif u < 0x10000:
                out[o] = <uint8_t>(0xE0 | (u >> 12))
                out[o + 1] = <uint8_t>(0x80 | ((u >> 6) & 0x3F))
                out[o + 2] = <uint8_t>(0x80 | (u & 0x3F))
                o += 3
            else:
                out[o] = <uint8_t>(0xF0 | (u >> 18))
                out[o + 1] = <uint8_t>(0x80 | ((u >> 12) & 0x3F))
                out[o + 2] = <uint8_t>(0x80 | ((u >> 6) & 0x3F))
                out[o + 3] = <uint8_t>(0x80 | (u & 0x3F))
                o += 4
        elif c == 98:
            out[o] = 8
            o += 1
        elif c == 102:
            out[o] = 12
            o += 1
        elif c == 110:
            out[o] = 10
            o += 1
        elif c == 114:
            out[o] = 13
            o += 1
        elif c == 116:
            out[o] = 9
            o += 1
        else:                  # \" \\ \/
            out[o] = c
            o += 1
    return o


cdef Py_ssize_t find_tag(const uint8_t* p, Py_ssize_t n, Py_ssize_t* tlen) noexcept nogil:
    """Start of the TAGS value in decoded properties (-1: none), its length in tlen.

    The broker's reading: entries split at \\x02; an entry of at least 3 bytes whose first \\x01
    leaves a non-empty name and a non-empty value is a property; the last TAGS wins.
    """
    cdef Py_ssize_t index = 0, nxt, kv, found = -1
    cdef const uint8_t* q
    while index < n:
        q = <const uint8_t*>memchr(p + index, 2, n - index)
        nxt = q - p if q != NULL else n
        if nxt - index >= 3:
            q = <const uint8_t*>memchr(p + index, 1, nxt - index)
            if q != NULL:
                kv = q - p
                if kv > index and kv < nxt - 1 and kv - index == 4 and memcmp(p + index, b"TAGS", 4) == 0:
                    found = kv + 1
                    tlen[0] = nxt - found
        index = nxt + 1
    return found


cdef bint is_delay_name(const uint8_t* k, Py_ssize_t n) noexcept nogil:
    """DELAY, TIMER_DELAY_SEC, TIMER_DELAY_MS, TIMER_DELIVER_MS or __STARTDELIVERTIME."""
    if n == 5:
        return memcmp(k, b"DELAY", 5) == 0
    if n == 14:
        return memcmp(k, b"TIMER_DELAY_MS", 14) == 0
    if n == 15:
        return memcmp(k, b"TIMER_DELAY_SEC", 15) == 0
    if n == 16:
        return memcmp(k, b"TIMER_DELIVER_MS", 16) == 0
    if n == 18:
        return memcmp(k, b"__STARTDELIVERTIME", 18) == 0
    return False


cdef bint find_delay(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """True when decoded properties hold a delivery-time property as the broker reads them (the
    entries find_tag reads: at least 3 bytes, a non-empty name before the first \\x01 and a
    non-empty value)."""
    cdef Py_ssize_t index = 0, nxt, kv
    cdef const uint8_t* q
    while index < n:
        q = <const uint8_t*>memchr(p + index, 2, n - index)
        nxt = q - p if q != NULL else n
        if nxt - index >= 3:
            q = <const uint8_t*>memchr(p + index, 1, nxt - index)
            if q != NULL:
                kv = q - p
                if kv > index and kv < nxt - 1 and is_delay_name(p + index, kv - index):
                    return True
        index = nxt + 1
    return False


cdef uint8_t* _props_buf = NULL     # decoded escaped properties (one scanner runs at a time per process)
cdef Py_ssize_t _props_cap = 0


cdef const uint8_t* props_tag(const uint8_t* props, Py_ssize_t plen, bint esc, Py_ssize_t* glen) noexcept:
    """The TAGS value of a send's properties as the broker reads it (NULL: none); length in glen."""
    global _props_buf, _props_cap
    cdef const uint8_t* p = props
    cdef Py_ssize_t n = plen, s
    cdef uint8_t* grown
    if esc:
        if plen > _props_cap:
            grown = <uint8_t*>realloc(_props_buf, plen)
            if grown == NULL:
                return NULL
            _props_buf = grown
            _props_cap = plen
        n = json_unescape(props, plen, _props_buf)
        p = _props_buf
    s = find_tag(p, n, glen)
    return p + s if s >= 0 else NULL


cdef bint props_delay(const uint8_t* props, Py_ssize_t plen, bint esc) noexcept:
    """True when a send's properties (JSON-escaped when ``esc``) ask for a delivery time; True
    too when escaped properties cannot be decoded here (out of memory: the policy decides)."""
    global _props_buf, _props_cap
    cdef const uint8_t* p = props
    cdef Py_ssize_t n = plen
    cdef uint8_t* grown
    if esc:
        if plen > _props_cap:
            grown = <uint8_t*>realloc(_props_buf, plen)
            if grown == NULL:
                return True
            _props_buf = grown
            _props_cap = plen
        n = json_unescape(props, plen, _props_buf)
        p = _props_buf
    return find_delay(p, n)
