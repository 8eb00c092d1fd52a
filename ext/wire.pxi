# Included by _speedups.pyx. Reading the wire: big-endian integers and the monotonic clock.

cdef extern from "<time.h>" nogil:
    ctypedef int clockid_t
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(clockid_t clk, timespec* ts)
    enum: CLOCK_MONOTONIC


cdef inline int64_t monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int32_t rd_i32(const uint8_t* p) nogil:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3])


cdef inline int16_t rd_i16(const uint8_t* p) nogil:
    return <int16_t>((<uint16_t>p[0] << 8) | <uint16_t>p[1])


cdef inline uint16_t rd_u16(const uint8_t* p) nogil:
    return <uint16_t>((<uint16_t>p[0] << 8) | <uint16_t>p[1])
