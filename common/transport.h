// Transport settings for MB-sized messages, shared by the server's ports and the clients'
// channels: large HTTP/2 windows and frames, and large socket reads, so that a message is
// moved in few big pieces (docs/PERFORMANCE.md#design-decisions has the numbers behind them).
#pragma once

#include <array>
#include <utility>

namespace pagedattn {

// The largest piece a connection's bytes are read in: the server's memory for requests in
// flight (--request_memory_mb) must hold at least one.
inline constexpr int kMaxReadChunkBytes = 16 << 20;

// gRPC channel arguments (name, integer value).
inline constexpr std::array<std::pair<const char*, int>, 6> kTransportArgs = {{
    {"grpc.http2.lookahead_bytes", 16 << 20},            // the initial stream window
    {"grpc.http2.max_frame_size", (16 << 20) - 1},       // the largest HTTP/2 allows
    {"grpc.http2.write_buffer_size", 16 << 20},          // bytes queued per write
    {"grpc.experimental.tcp_read_chunk_size", 4 << 20},  // socket reads
    {"grpc.experimental.tcp_min_read_chunk_size", 1 << 20},
    {"grpc.experimental.tcp_max_read_chunk_size", kMaxReadChunkBytes},
}};

// Clients' reconnect backoff: gRPC's default grows to 120 s (a caller that kept calling through
// a 30 s restart kept failing for 11-15 s after the server was back). gRPC's minimum reconnect
// backoff stays its own: it is also a connection attempt's deadline, and 250 ms failed TLS
// handshakes of a loaded machine.
inline constexpr int kInitialReconnectBackoffMs = 250;
inline constexpr int kMaxReconnectBackoffMs = 2000;
// The least time between two resolutions of a client's target. Debian's gRPC (1.51) reconnects
// after a failed attempt only when a resolution comes back before the attempt's backoff ends
// (pick_first leaves the subchannel idle, retrying every 5 s); gRPC's default of 30 s between
// resolutions made a caller calling every 50 ms fail for 9-10 s after a server restarted (5 s
// to a server that came up 30 ms after the client). Under the backoff's least step (250 ms less
// its 20% jitter): 0.2-0.4 s, 1.8 s after a 10 s outage (the 2 s backoff). gRPC resolves a name
// again only when a connection fails or drops, so a connected client looks up nothing; while
// its server is down, it looks the name up once a reconnect attempt (about 4 a second at first,
// one each 2 s from the sixth on).
inline constexpr int kMinResolutionIntervalMs = 100;

// The largest message the server accepts and sends by default, and what clients accept.
inline constexpr int kDefaultMaxMessageBytes = 512 << 20;

}  // namespace pagedattn
