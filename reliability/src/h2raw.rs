//! HTTP/2 frames written by hand, for the hostile clients: a real client
//! library would refuse to misbehave (send 10 MB of headers past the peer's
//! limit, reset every stream it opens, never read). Only what they need —
//! the preface, SETTINGS, HEADERS/CONTINUATION with literal HPACK, DATA and
//! RST_STREAM — per RFC 9113 and RFC 7541.

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
/// RST_STREAM's CANCEL error code.
pub const CANCEL: u32 = 0x8;
/// The largest frame payload every peer accepts (SETTINGS_MAX_FRAME_SIZE's
/// initial value).
pub const MAX_FRAME: usize = 16_384;

/// One frame: 9-byte header, then the payload.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = u32::try_from(payload.len()).expect("a frame under 16 MiB");
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&length.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The preface and an empty SETTINGS frame: what opens a connection.
pub fn open() -> Vec<u8> {
    [PREFACE, &frame(SETTINGS, 0, 0, &[])].concat()
}

/// HPACK integer with an `prefix_bits`-bit prefix (RFC 7541 §5.1).
fn integer(out: &mut Vec<u8>, first_byte_flags: u8, prefix_bits: u32, value: usize) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(first_byte_flags | value as u8);
        return;
    }
    out.push(first_byte_flags | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A header block of literal fields without indexing, new names, no
/// Huffman (RFC 7541 §6.2.2): any HPACK decoder reads it.
pub fn header_block(fields: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0x00);
        integer(&mut out, 0, 7, name.len());
        out.extend_from_slice(name.as_bytes());
        integer(&mut out, 0, 7, value.len());
        out.extend_from_slice(value);
    }
    out
}

/// The pseudo-headers and headers of a gRPC call to `method`, plus `extra`.
pub fn grpc_request_block(method: &str, extra: &[(&str, &[u8])]) -> Vec<u8> {
    let path = format!("/dedup.v1.ClaimAndCommit/{method}");
    let mut fields: Vec<(&str, &[u8])> = vec![
        (":method", b"POST"),
        (":scheme", b"http"),
        (":path", path.as_bytes()),
        (":authority", b"localhost"),
        ("content-type", b"application/grpc"),
        ("te", b"trailers"),
    ];
    fields.extend_from_slice(extra);
    header_block(&fields)
}

/// HEADERS carrying `block` on `stream` (split into CONTINUATION frames as
/// needed); the stream stays open for a body unless `end_stream`.
pub fn headers(stream: u32, block: &[u8], end_stream: bool) -> Vec<u8> {
    let mut chunks = block.chunks(MAX_FRAME).peekable();
    let mut out = Vec::with_capacity(block.len() + 64);
    let mut kind = HEADERS;
    let mut stream_flag = if end_stream { END_STREAM } else { 0 };
    if chunks.peek().is_none() {
        return frame(HEADERS, stream_flag | END_HEADERS, stream, &[]);
    }
    while let Some(chunk) = chunks.next() {
        let last = if chunks.peek().is_none() {
            END_HEADERS
        } else {
            0
        };
        out.extend(frame(kind, stream_flag | last, stream, chunk));
        kind = CONTINUATION;
        stream_flag = 0;
    }
    out
}

/// A DATA frame holding one gRPC message (uncompressed, length-prefixed),
/// ending the stream.
pub fn grpc_data(stream: u32, message: &[u8]) -> Vec<u8> {
    let length = u32::try_from(message.len()).expect("a message under 4 GiB");
    let mut payload = vec![0u8];
    payload.extend_from_slice(&length.to_be_bytes());
    payload.extend_from_slice(message);
    frame(DATA, END_STREAM, stream, &payload)
}

/// RST_STREAM with `code`.
pub fn rst_stream(stream: u32, code: u32) -> Vec<u8> {
    frame(RST_STREAM, 0, stream, &code.to_be_bytes())
}

const PING: u8 = 0x6;
const ACK: u8 = 0x1;
/// SETTINGS_INITIAL_WINDOW_SIZE (RFC 9113 §6.5.2).
const INITIAL_WINDOW_SIZE: u16 = 0x4;

/// The preface and a SETTINGS frame granting each stream `window` bytes:
/// the server may send no more of an answer's body until a WINDOW_UPDATE
/// that never comes.
pub fn open_with_window(window: u32) -> Vec<u8> {
    let mut setting = INITIAL_WINDOW_SIZE.to_be_bytes().to_vec();
    setting.extend_from_slice(&window.to_be_bytes());
    [PREFACE, &frame(SETTINGS, 0, 0, &setting)].concat()
}

/// A DATA frame carrying `payload`, ending the stream.
pub fn data(stream: u32, payload: &[u8]) -> Vec<u8> {
    frame(DATA, END_STREAM, stream, payload)
}

/// What [`converse`] saw of the server.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Heard {
    /// Streams reset with CANCEL at least the wait given after their
    /// answer's HEADERS: the server gave up on an answer not taken.
    pub cancelled: u64,
    /// Other RST_STREAM frames (another reason, or too soon).
    pub other_resets: u64,
    /// Whether it closed the connection.
    pub closed: bool,
}

/// Reads the server's frames, acknowledging its SETTINGS and answering its
/// PINGs as a live client does (and nothing else: no WINDOW_UPDATE), until
/// `done` says enough of what was heard, `stop` is set, or the connection
/// ends. A stream reset with CANCEL counts in [`Heard::cancelled`] only
/// `min_wait` or more after its answer's HEADERS came.
pub async fn converse(
    socket: &mut tokio::net::TcpStream,
    stop: &std::sync::atomic::AtomicBool,
    min_wait: std::time::Duration,
    done: impl Fn(&Heard) -> bool,
) -> Heard {
    use std::{collections::HashMap, sync::atomic::Ordering::Relaxed, time::Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut heard = Heard::default();
    let mut answered: HashMap<u32, Instant> = HashMap::new();
    let mut buffer = Vec::with_capacity(64 << 10);
    let mut chunk = vec![0u8; 64 << 10];
    while !stop.load(Relaxed) && !done(&heard) {
        let read = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            socket.read(&mut chunk),
        )
        .await;
        match read {
            Err(_) => continue,
            Ok(Ok(0) | Err(_)) => {
                heard.closed = true;
                return heard;
            }
            Ok(Ok(n)) => buffer.extend_from_slice(&chunk[..n]),
        }
        let mut replies = Vec::new();
        while buffer.len() >= 9 {
            let length = u32::from_be_bytes([0, buffer[0], buffer[1], buffer[2]]) as usize;
            if buffer.len() < 9 + length {
                break;
            }
            let (kind, flags) = (buffer[3], buffer[4]);
            let stream =
                u32::from_be_bytes([buffer[5], buffer[6], buffer[7], buffer[8]]) & 0x7fff_ffff;
            let payload = &buffer[9..9 + length];
            match kind {
                SETTINGS if flags & ACK == 0 => replies.extend(frame(SETTINGS, ACK, 0, &[])),
                PING if flags & ACK == 0 => replies.extend(frame(PING, ACK, 0, payload)),
                HEADERS => {
                    answered.entry(stream).or_insert_with(Instant::now);
                }
                RST_STREAM if length == 4 => {
                    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    let waited = answered.remove(&stream).map(|at| at.elapsed());
                    if code == CANCEL && waited.is_some_and(|waited| waited >= min_wait) {
                        heard.cancelled += 1;
                    } else {
                        heard.other_resets += 1;
                    }
                }
                _ => {}
            }
            buffer.drain(..9 + length);
        }
        if !replies.is_empty() && socket.write_all(&replies).await.is_err() {
            heard.closed = true;
            return heard;
        }
    }
    heard
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_follow_rfc_7541_c_1() {
        // C.1.1: 10 with a 5-bit prefix; C.1.2: 1337 with a 5-bit prefix.
        let mut out = Vec::new();
        integer(&mut out, 0, 5, 10);
        assert_eq!(out, [0x0a]);
        out.clear();
        integer(&mut out, 0, 5, 1337);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
    }

    #[test]
    fn a_literal_field_follows_rfc_7541_c_2_2() {
        // C.2.2 encodes ":path: /sample/path" with an indexed name; the same
        // field with a literal name is 0x00, the name, then the value.
        let block = header_block(&[("custom-key", b"custom-header")]);
        let mut expected = vec![0x00, 0x0a];
        expected.extend_from_slice(b"custom-key");
        expected.push(0x0d);
        expected.extend_from_slice(b"custom-header");
        assert_eq!(block, expected);
    }

    #[test]
    fn a_large_block_is_split_into_continuations() {
        let block = vec![0u8; MAX_FRAME * 2 + 1];
        let frames = headers(1, &block, false);
        assert_eq!(frames.len(), block.len() + 3 * 9);
        assert_eq!((frames[3], frames[4]), (HEADERS, 0));
        let second = 9 + MAX_FRAME;
        assert_eq!((frames[second + 3], frames[second + 4]), (CONTINUATION, 0));
        let third = 2 * (9 + MAX_FRAME);
        assert_eq!(
            (frames[third + 3], frames[third + 4]),
            (CONTINUATION, END_HEADERS)
        );
    }
}
