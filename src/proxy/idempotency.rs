//! What draft-ietf-httpapi-idempotency-key-header defines, as pure
//! functions for the HTTP proxy face: the `Idempotency-Key` header's value
//! (the draft's quoted string, or Stripe's bare token), the record a keyed
//! request maps to (scoped by method, route and caller — a hash of the
//! caller's credentials by default — so two clients' keys never collide),
//! the payload fingerprint (RFC 8785 canonical JSON, so key order and
//! whitespace do not matter, except for numbers JSON's doubles cannot hold),
//! which responses are kept for replay, and what is stored: a response, or
//! the fact that the request's outcome is unknown.

use http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use sha2::{Digest, Sha256};

/// Where a key is required (`--require-key`): an optional method and a
/// path pattern. A path pattern is `*` (every route) or `/`-separated
/// segments where `*` matches one segment and a final `**` matches the
/// rest, none included: `POST /payments/**`, `/orders/*/refunds`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePattern {
    method: Option<Method>,
    /// `None`: every path.
    segments: Option<Vec<String>>,
}

impl RoutePattern {
    /// Parses `[METHOD ]PATH-PATTERN`; the error says what is wrong.
    pub fn parse(text: &str) -> Result<RoutePattern, String> {
        let text = text.trim();
        let (method, path) = match text.split_once(char::is_whitespace) {
            Some((method, path)) => {
                let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("{method:?} is not an HTTP method"))?;
                (Some(method), path.trim())
            }
            None => (None, text),
        };
        if path == "*" {
            return Ok(RoutePattern {
                method,
                segments: None,
            });
        }
        let Some(rest) = path.strip_prefix('/') else {
            return Err(format!(
                "{path:?} is neither * nor a path starting with / (e.g. /payments/**)"
            ));
        };
        let segments: Vec<String> = rest.split('/').map(str::to_owned).collect();
        if let Some(position) = segments.iter().position(|segment| segment == "**") {
            if position + 1 != segments.len() {
                return Err(format!("{path:?}: ** may only end a pattern"));
            }
        }
        Ok(RoutePattern {
            method,
            segments: Some(segments),
        })
    }

    /// The method this pattern is limited to, if any.
    pub fn method(&self) -> Option<&Method> {
        self.method.as_ref()
    }

    /// Whether a request to `path` with `method` falls under the pattern.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        if self.method.as_ref().is_some_and(|own| own != method) {
            return false;
        }
        let Some(pattern) = &self.segments else {
            return true;
        };
        let mut path = path.strip_prefix('/').unwrap_or(path).split('/');
        for segment in pattern {
            match (segment.as_str(), path.next()) {
                ("**", _) => return true,
                (_, None) => return false,
                ("*", Some(_)) => {}
                (literal, Some(actual)) if literal == actual => {}
                (_, Some(_)) => return false,
            }
        }
        path.next().is_none()
    }
}

/// The draft's limit on a key's length, in characters.
pub const MAX_KEY_CHARS: usize = 255;

/// Why an `Idempotency-Key` header is refused (answered 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyProblem {
    /// Neither an RFC 8941 sf-string (`"..."`) nor, unless the syntax is
    /// strict, a bare token.
    #[error("Idempotency-Key must be a quoted structured-field string, e.g. \"8e03978e-40d5-43e8-bc93-6894a57f9324\"{bare}: {detail}", bare = if *.strict { "" } else { ", or a bare key of visible ASCII characters without quotes, commas or spaces" }, detail = .detail)]
    Malformed {
        /// Whether only the draft's quoted form is accepted.
        strict: bool,
        /// What is wrong with it.
        detail: String,
    },
    /// `""`.
    #[error("Idempotency-Key must not be empty")]
    Empty,
    /// Longer than [`MAX_KEY_CHARS`].
    #[error("Idempotency-Key is {0} characters long; the limit is {MAX_KEY_CHARS}")]
    TooLong(usize),
}

/// Which spellings of a key are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeySyntax {
    /// The draft's quoted sf-string, or a bare token of visible ASCII
    /// without quotes, commas or whitespace (what Stripe's SDKs and most
    /// clients send); both spellings of one key are the same key.
    #[default]
    Lenient,
    /// The draft's quoted sf-string only (`--strict-key-syntax`).
    Strict,
}

/// A client's idempotency key, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses the header value: 1 to 255 characters, as an sf-string or,
    /// with [`KeySyntax::Lenient`], as a bare token. `abc` and `"abc"` are
    /// the same key.
    pub fn parse(value: &HeaderValue, syntax: KeySyntax) -> Result<IdempotencyKey, KeyProblem> {
        let strict = syntax == KeySyntax::Strict;
        let malformed = |detail: String| KeyProblem::Malformed { strict, detail };
        let quoted = sfv::Parser::new(value.as_bytes())
            .parse::<sfv::Item>()
            .map_err(|error| error.to_string())
            .and_then(|item| match item.bare_item.as_string() {
                Some(text) => Ok(text.as_str().to_owned()),
                None => Err(format!(
                    "{:?} is not a string",
                    String::from_utf8_lossy(value.as_bytes())
                )),
            });
        let text = match (quoted, syntax) {
            (Ok(text), _) => text,
            (Err(detail), KeySyntax::Strict) => return Err(malformed(detail)),
            (Err(_), KeySyntax::Lenient) => {
                let bare = value.as_bytes();
                if bare.first() == Some(&b'"') {
                    return Err(malformed(
                        "an unterminated or malformed quoted string".into(),
                    ));
                }
                if let Some(byte) = bare.iter().find(|byte| !is_bare_key_byte(**byte)) {
                    return Err(malformed(format!(
                        "{:?} may not appear in a bare key",
                        char::from(*byte)
                    )));
                }
                String::from_utf8_lossy(bare).into_owned()
            }
        };
        match text.chars().count() {
            0 => Err(KeyProblem::Empty),
            length if length > MAX_KEY_CHARS => Err(KeyProblem::TooLong(length)),
            _ => Ok(IdempotencyKey(text)),
        }
    }

    /// The key as the client meant it (without the quotes).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Visible ASCII except the quote and the comma, which would make a bare
/// key look like (part of) a structured field.
fn is_bare_key_byte(byte: u8) -> bool {
    matches!(byte, b'!'..=b'~') && byte != b'"' && byte != b','
}

/// Who a record belongs to, besides method and route: what the proxy hashes
/// into every key's scope so that two callers never share a record.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CallerScope {
    /// The request's credentials: every value of `Authorization`,
    /// `Proxy-Authorization` and `X-API-Key` present, or, when there is
    /// none of them, every `Cookie` value (the default).
    #[default]
    Credentials,
    /// Every value of these headers, in order (`--scope-header`).
    Headers(Vec<HeaderName>),
    /// Nobody: every caller shares records (`--scope none`).
    Shared,
}

/// The headers that carry a caller's credentials, hashed together.
/// Cookies count only without them: a browser's cookie jar changes between
/// attempts (analytics, CSRF), and a changed scope is a new caller whose
/// retry is sent again.
const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "proxy-authorization", "x-api-key"];

impl CallerScope {
    /// What a request must carry to be identified (for the refusal).
    pub fn expected(&self) -> String {
        match self {
            CallerScope::Credentials => {
                "an Authorization, Proxy-Authorization or X-API-Key header, or a cookie".into()
            }
            CallerScope::Headers(names) => {
                let names: Vec<&str> = names.iter().map(HeaderName::as_str).collect();
                format!("one of the headers {}", names.join(", "))
            }
            CallerScope::Shared => "nothing".into(),
        }
    }

    /// A SHA-256 of the caller's identity as this scope sees it, or `None`
    /// when the request carries none (an anonymous caller, which the proxy
    /// refuses unless the scope is [`CallerScope::Shared`]).
    pub fn identity(&self, headers: &HeaderMap) -> Option<[u8; 32]> {
        let names: Vec<HeaderName> = match self {
            CallerScope::Shared => return None,
            CallerScope::Headers(names) => names.clone(),
            CallerScope::Credentials => {
                let present: Vec<HeaderName> = CREDENTIAL_HEADERS
                    .iter()
                    .map(|name| HeaderName::from_static(name))
                    .filter(|name| headers.contains_key(name))
                    .collect();
                if present.is_empty() {
                    vec![header::COOKIE]
                } else {
                    present
                }
            }
        };
        if names.iter().all(|name| !headers.contains_key(name)) {
            return None;
        }
        let mut hash = Sha256::new();
        for name in &names {
            hash_values(&mut hash, headers, name);
        }
        Some(hash.finalize().into())
    }
}

/// Adds every value of header `name` to `hash`: the name and the number of
/// values first, so that "no header" and "one empty value" differ and
/// values cannot slide between headers.
fn hash_values(hash: &mut Sha256, headers: &HeaderMap, name: &HeaderName) {
    let values = headers.get_all(name);
    hash.update((name.as_str().len() as u64).to_be_bytes());
    hash.update(name.as_str());
    hash.update((values.iter().count() as u64).to_be_bytes());
    for value in values {
        hash.update((value.len() as u64).to_be_bytes());
        hash.update(value.as_bytes());
    }
}

/// What a key is scoped by: two requests share a record only when all of
/// this and the key are equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope<'a> {
    /// The request method.
    pub method: &'a Method,
    /// The route: the request path (the query is part of the fingerprint,
    /// not of the scope, so a retry with another query is a mismatch).
    pub route: &'a str,
    /// The caller's identity ([`CallerScope::identity`]), if any.
    pub caller: Option<&'a [u8]>,
}

impl Scope<'_> {
    /// The correlation ID the record is kept under: a hex SHA-256 of the
    /// scope and the key, so it has a fixed length whatever the key holds
    /// and never carries the caller's credentials in the clear.
    pub fn record_id(&self, key: &IdempotencyKey) -> String {
        let mut hash = Sha256::new();
        for part in [
            self.method.as_str().as_bytes(),
            self.route.as_bytes(),
            self.caller.unwrap_or_default(),
            key.as_str().as_bytes(),
        ] {
            // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part);
        }
        hex(&hash.finalize())
    }
}

/// The largest JSON body fingerprinted in canonical form; a larger one is
/// fingerprinted byte for byte (a retry must then send the same bytes).
pub const CANONICAL_JSON_MAX_BYTES: usize = 1 << 20;

/// The payload fingerprint: SHA-256 over the method, path, query and body,
/// with a JSON body (by its `Content-Type`) in RFC 8785 canonical form. A
/// body that claims JSON but does not parse is taken byte for byte. A
/// number an IEEE double (what RFC 8785 writes) cannot hold exactly — an
/// ID such as 9007199254740993 — keeps its exact value ([`exact_numbers`]),
/// so it never fingerprints equal to its nearest double.
pub fn fingerprint(
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: &[u8],
    fingerprint_headers: &[HeaderName],
) -> String {
    // Past a size, the raw bytes: a parsed JSON document takes many times
    // its text in memory and CPU, on the request path.
    let canonicalise = is_json(headers) && body.len() <= CANONICAL_JSON_MAX_BYTES;
    let exact = canonicalise.then(|| exact_numbers(body)).flatten();
    let canonical = canonicalise
        .then(|| serde_json::from_slice::<serde_json::Value>(exact.as_deref().unwrap_or(body)).ok())
        .flatten()
        .and_then(|value| serde_jcs::to_vec(&value).ok());
    let mut hash = Sha256::new();
    for part in [
        method.as_str().as_bytes(),
        path.as_bytes(),
        query.unwrap_or_default().as_bytes(),
        canonical.as_deref().unwrap_or(body),
    ] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    // `--fingerprint-header` (an account-selecting header such as
    // `Stripe-Account`): the same key and body for another account is
    // another request. Nothing is added without one, so fingerprints
    // stored before the flag existed still match.
    for name in fingerprint_headers {
        hash_values(&mut hash, headers, name);
    }
    hex(&hash.finalize())
}

/// The JSON text `body` with every number that does not mean exactly the
/// value of the double it parses to (as `10`, `1e1` and `0.5` do, and `0.1`
/// does by JSON's own rule that it is the nearest double) written as a
/// string of its exact decimal value (`"\u0000number:9007199254740993e0"`),
/// so that canonical JSON keeps it apart from its neighbours while key
/// order and spacing still do not matter; `None` when there is no such
/// number (or the text is not JSON: the parser decides then). A client
/// could only make its own payloads collide with such a string.
fn exact_numbers(body: &[u8]) -> Option<Vec<u8>> {
    let mut rewritten: Option<Vec<u8>> = None;
    let mut copied = 0;
    let mut position = 0;
    let mut in_string = false;
    while position < body.len() {
        let byte = body[position];
        if in_string {
            match byte {
                b'\\' => position += 1,
                b'"' => in_string = false,
                _ => {}
            }
            position += 1;
            continue;
        }
        match byte {
            b'"' => {
                in_string = true;
                position += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = position;
                while position < body.len()
                    && matches!(
                        body[position],
                        b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
                    )
                {
                    position += 1;
                }
                let text = std::str::from_utf8(&body[start..position]).ok()?;
                // Rust's float syntax is wider than JSON's (`09`, `1.`):
                // a token JSON refuses makes the body not JSON at all.
                if !is_json_number(text) {
                    return None;
                }
                let double = text.parse::<f64>().ok()?;
                let exact = decimal(text);
                if double.is_finite() && exact.is_some() && exact == decimal(&format!("{double:e}"))
                {
                    continue;
                }
                let out = rewritten.get_or_insert_with(Vec::new);
                out.extend_from_slice(&body[copied..start]);
                let value = match exact {
                    Some((negative, digits, exponent)) => {
                        let sign = if negative { "-" } else { "" };
                        format!("{sign}{digits}e{exponent}")
                    }
                    // An exponent past i64: its literal text.
                    None => format!("text:{text}"),
                };
                out.extend_from_slice(format!("\"\\u0000number:{value}\"").as_bytes());
                copied = position;
            }
            _ => position += 1,
        }
    }
    let mut out = rewritten?;
    out.extend_from_slice(&body[copied..]);
    Some(out)
}

/// Whether `text` is a number by JSON's grammar (RFC 8259 §6):
/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
fn is_json_number(text: &str) -> bool {
    let digits =
        |text: &str| text.len() - text.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let mut rest = text.strip_prefix('-').unwrap_or(text);
    match digits(rest) {
        0 => return false,
        n if n > 1 && rest.starts_with('0') => return false,
        n => rest = &rest[n..],
    }
    if let Some(fraction) = rest.strip_prefix('.') {
        match digits(fraction) {
            0 => return false,
            n => rest = &fraction[n..],
        }
    }
    if let Some(exponent) = rest.strip_prefix(['e', 'E']) {
        let exponent = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
        match digits(exponent) {
            0 => return false,
            n => rest = &exponent[n..],
        }
    }
    rest.is_empty()
}

/// A decimal number's value as (negative, significant digits, exponent of
/// the last digit), so `1e1`, `10` and `10.0` compare equal; zero is one
/// value whatever its sign. `None` when the exponent does not fit an i64.
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(at) => (&text[..at], text[at + 1..].parse::<i64>().ok()?),
        None => (text, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    let trimmed = digits.trim_start_matches('0');
    let without_trailing = trimmed.trim_end_matches('0');
    if without_trailing.is_empty() {
        return Some((false, String::new(), 0));
    }
    let exponent = exponent
        .checked_sub(i64::try_from(fraction.len()).ok()?)?
        .checked_add(i64::try_from(trimmed.len() - without_trailing.len()).ok()?)?;
    Some((negative, without_trailing.to_owned(), exponent))
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(|media| {
            let media = media.trim().to_ascii_lowercase();
            media == "application/json"
                || (media.starts_with("application/") && media.ends_with("+json"))
        })
        .unwrap_or(false)
}

/// What an upstream answer to a keyed request does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The answer is the outcome (whatever its status): kept and replayed
    /// to retries.
    Keep,
    /// The service says it did not act (`--release-on-status`,
    /// `--release-on-grpc-code`): the key is released and a retry is sent
    /// again.
    Release,
    /// A gateway in front of the service lost its answer, or the call was
    /// cut off (it may have acted): recorded as outcome unknown, never sent
    /// again.
    Unknown,
}

/// The answers that say "the service did not act, try again": the only
/// answers after which a keyed request is sent again (SPEC §6). Everything
/// else a service answers — 5xx and gRPC UNKNOWN/INTERNAL included — is the
/// outcome: a service that charged and then failed to build its answer
/// must not charge again when the client retries (as Stripe does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseOn {
    /// HTTP statuses (400–599).
    pub statuses: Vec<StatusCode>,
    /// gRPC codes (1–16).
    pub grpc_codes: Vec<u32>,
}

impl Default for ReleaseOn {
    /// 408, 409, 425 and 429 (timed out before acting, conflict, too
    /// early, too many requests); gRPC ABORTED ("aborted before
    /// committing", which HTTP 409 maps to). Not RESOURCE_EXHAUSTED:
    /// grpc-go and grpc-java also answer it when the server's own answer
    /// is over its send limit, after the handler acted.
    fn default() -> ReleaseOn {
        ReleaseOn {
            statuses: [408, 409, 425, 429]
                .into_iter()
                .map(|code| StatusCode::from_u16(code).expect("a status"))
                .collect(),
            grpc_codes: vec![10],
        }
    }
}

impl ReleaseOn {
    /// What an HTTP status does to its key: released when the operator's
    /// set says the service did not act; 502, 503 and 504 mean a gateway
    /// got no (valid, timely) answer from the server behind it (RFC 9110
    /// §15.6.3–§15.6.5): the outcome is unknown; anything else is kept.
    pub fn http(&self, status: StatusCode) -> Disposition {
        if self.statuses.contains(&status) {
            return Disposition::Release;
        }
        match status.as_u16() {
            502..=504 => Disposition::Unknown,
            // 101: the connection was handed over; whatever happened is
            // not an answer dedupd can keep.
            _ if status.is_informational() => Disposition::Unknown,
            _ => Disposition::Keep,
        }
    }

    /// What a gRPC answer does to its key, by its `grpc-status` (none: an
    /// intermediary's non-gRPC answer, unknown). Released when the
    /// operator's set says so; CANCELLED, DEADLINE_EXCEEDED and
    /// UNAVAILABLE after the call was sent mean it was cut off while the
    /// handler may have gone on: unknown; anything else (OK, the codes that
    /// judge the request, and UNKNOWN, INTERNAL, DATA_LOSS, what a server
    /// answers for an uncaught exception) is kept.
    pub fn grpc(&self, code: Option<u32>) -> Disposition {
        match code {
            Some(code) if self.grpc_codes.contains(&code) => Disposition::Release,
            None | Some(1 | 4 | 14) => Disposition::Unknown,
            Some(_) => Disposition::Keep,
        }
    }
}

/// Headers that describe one connection, not the response (RFC 9110
/// §7.6.1), plus those the `Connection` header names: never stored.
pub fn end_to_end(headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    const HOP_BY_HOP: [&str; 8] = [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ];
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    headers
        .iter()
        .filter(|(name, _)| {
            !HOP_BY_HOP.contains(&name.as_str()) && !named.iter().any(|n| n == name.as_str())
        })
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

/// The end-to-end headers of an upstream answer that may be stored and
/// replayed: never `Set-Cookie` (a session given to the first caller is not
/// handed to whoever retries), nor any header in `never_store`
/// (`--never-store-header`).
pub fn storable(headers: &HeaderMap, never_store: &[HeaderName]) -> Vec<(HeaderName, HeaderValue)> {
    end_to_end(headers)
        .into_iter()
        .filter(|(name, _)| may_store(name, never_store))
        .collect()
}

/// Whether a response header may be stored and replayed (see [`storable`]).
pub fn may_store(name: &HeaderName, never_store: &[HeaderName]) -> bool {
    *name != header::SET_COOKIE && !never_store.contains(name)
}

/// What a keyed request's record holds once it is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// The upstream's answer, replayed to retries.
    Response(StoredResponse),
    /// The request may have reached the upstream, but no complete answer
    /// came back (a timeout, a reset, or the proxy died while it waited):
    /// it is never forwarded again, and retries are told to reconcile.
    OutcomeUnknown {
        /// Why, for the retries' answer.
        reason: String,
    },
}

/// A response kept for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The upstream's status.
    pub status: StatusCode,
    /// Its end-to-end headers, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Its body; `None` when it was over `--max-response-bytes` (the key is
    /// committed, the result is not replayable).
    pub body: Option<Vec<u8>>,
    /// Its trailers (gRPC's `grpc-status` and `grpc-message`), in order.
    pub trailers: Vec<(HeaderName, HeaderValue)>,
}

/// Why stored bytes are not a [`StoredResponse`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stored response is malformed: {0}")]
pub struct DecodeError(&'static str);

/// The first byte of a stored [`Stored::Response`] (the only form before
/// outcome-unknown records existed, so older records still decode).
const FORMAT_VERSION: u8 = 1;
/// The first byte of a stored [`Stored::OutcomeUnknown`].
const OUTCOME_UNKNOWN: u8 = 2;

impl Stored {
    /// Encodes it for the record's response field.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Stored::Response(response) => response.encode(),
            Stored::OutcomeUnknown { reason } => {
                let mut out = vec![OUTCOME_UNKNOWN];
                put(&mut out, reason.as_bytes());
                out
            }
        }
    }

    /// The inverse of [`Stored::encode`].
    pub fn decode(bytes: &[u8]) -> Result<Stored, DecodeError> {
        if bytes.first() != Some(&OUTCOME_UNKNOWN) {
            return StoredResponse::decode(bytes).map(Stored::Response);
        }
        let mut input = Reader(&bytes[1..]);
        let reason = String::from_utf8_lossy(input.field()?).into_owned();
        if !input.0.is_empty() {
            return Err(DecodeError("trailing bytes"));
        }
        Ok(Stored::OutcomeUnknown { reason })
    }
}

impl StoredResponse {
    /// Encodes it for the record's response field: a version byte, the
    /// status, the headers and the body, each length-prefixed.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![FORMAT_VERSION];
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        put_fields(&mut out, &self.headers);
        match &self.body {
            Some(body) => {
                out.push(1);
                put(&mut out, body);
            }
            None => out.push(0),
        }
        put_fields(&mut out, &self.trailers);
        out
    }

    /// The inverse of [`StoredResponse::encode`].
    pub fn decode(bytes: &[u8]) -> Result<StoredResponse, DecodeError> {
        let mut input = Reader(bytes);
        if input.take(1)? != [FORMAT_VERSION] {
            return Err(DecodeError("unknown format version"));
        }
        let status = u16::from_be_bytes(input.take(2)?.try_into().expect("two bytes"));
        let status = StatusCode::from_u16(status).map_err(|_| DecodeError("bad status"))?;
        let headers = input.fields()?;
        let body = match input.take(1)? {
            [1] => Some(input.field()?.to_vec()),
            [0] => None,
            _ => return Err(DecodeError("bad body marker")),
        };
        let trailers = input.fields()?;
        if !input.0.is_empty() {
            return Err(DecodeError("trailing bytes"));
        }
        Ok(StoredResponse {
            status,
            headers,
            body,
            trailers,
        })
    }
}

fn put_fields(out: &mut Vec<u8>, fields: &[(HeaderName, HeaderValue)]) {
    out.extend_from_slice(&(fields.len() as u32).to_be_bytes());
    for (name, value) in fields {
        put(out, name.as_str().as_bytes());
        put(out, value.as_bytes());
    }
}

fn put(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(&(field.len() as u32).to_be_bytes());
    out.extend_from_slice(field);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, count: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < count {
            return Err(DecodeError("truncated"));
        }
        let (taken, rest) = self.0.split_at(count);
        self.0 = rest;
        Ok(taken)
    }

    fn fields(&mut self) -> Result<Vec<(HeaderName, HeaderValue)>, DecodeError> {
        let count = u32::from_be_bytes(self.take(4)?.try_into().expect("four bytes"));
        let mut fields = Vec::new();
        for _ in 0..count {
            let name =
                HeaderName::from_bytes(self.field()?).map_err(|_| DecodeError("bad field name"))?;
            let value = HeaderValue::from_bytes(self.field()?)
                .map_err(|_| DecodeError("bad field value"))?;
            fields.push((name, value));
        }
        Ok(fields)
    }

    fn field(&mut self) -> Result<&'a [u8], DecodeError> {
        let length = u32::from_be_bytes(self.take(4)?.try_into().expect("four bytes"));
        self.take(length as usize)
    }
}

/// Lower-case hex, by table: `write!` per byte was 7% of a replay's CPU.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> Result<IdempotencyKey, KeyProblem> {
        IdempotencyKey::parse(&HeaderValue::from_str(text).unwrap(), KeySyntax::Strict)
    }

    fn lenient(text: &str) -> Result<IdempotencyKey, KeyProblem> {
        IdempotencyKey::parse(&HeaderValue::from_str(text).unwrap(), KeySyntax::Lenient)
    }

    #[test]
    fn a_strict_key_is_a_quoted_string_of_1_to_255_characters() {
        assert_eq!(key("\"abc-123\"").unwrap().as_str(), "abc-123");
        assert_eq!(
            key(&format!("\"{}\"", "k".repeat(255)))
                .unwrap()
                .as_str()
                .len(),
            255
        );
        assert_eq!(key("\"\""), Err(KeyProblem::Empty));
        assert_eq!(
            key(&format!("\"{}\"", "k".repeat(256))),
            Err(KeyProblem::TooLong(256))
        );
        for bad in ["abc", "42", "\"unterminated", "\"a\", \"b\"", ":Ynl0ZXM=:"] {
            let refused = key(bad);
            assert!(
                matches!(refused, Err(KeyProblem::Malformed { strict: true, .. })),
                "{bad} was accepted"
            );
            assert!(
                !refused.unwrap_err().to_string().contains("bare"),
                "the strict message offers the bare form"
            );
        }
    }

    #[test]
    fn a_bare_key_is_the_same_key_as_its_quoted_spelling() {
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(
            lenient(uuid).unwrap(),
            lenient(&format!("\"{uuid}\"")).unwrap()
        );
        assert_eq!(lenient(uuid).unwrap().as_str(), uuid);
        for bare in [
            "42",
            "abc",
            ":Ynl0ZXM=:",
            "order/7#1",
            "a;b=c",
            "~!$%&'()*+-./:<=>?@[]^_`{|}",
        ] {
            assert_eq!(lenient(bare).unwrap().as_str(), bare, "{bare}");
        }
        assert_eq!(lenient(&"k".repeat(255)).unwrap().as_str().len(), 255);
        assert_eq!(lenient(&"k".repeat(256)), Err(KeyProblem::TooLong(256)));
        assert_eq!(lenient(""), Err(KeyProblem::Empty));
        for bad in ["a b", "a,b", "\"open", "a\"b", "\"a\", \"b\"", "tab\there"] {
            assert!(
                matches!(
                    lenient(bad),
                    Err(KeyProblem::Malformed { strict: false, .. })
                ),
                "{bad:?} was accepted"
            );
        }
        // Non-ASCII bytes are no bare key either.
        let latin1 = HeaderValue::from_bytes(b"caf\xe9").unwrap();
        assert!(IdempotencyKey::parse(&latin1, KeySyntax::Lenient).is_err());
    }

    #[test]
    fn callers_are_told_apart_by_their_credentials_by_default() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                );
            }
            map
        };
        let by_credentials = CallerScope::Credentials;
        let alice = by_credentials.identity(&headers(&[("authorization", "Bearer alice")]));
        let bob = by_credentials.identity(&headers(&[("authorization", "Bearer bob")]));
        assert!(alice.is_some());
        assert_ne!(alice, bob);
        // Authorization wins over cookies; cookies count without it.
        assert_eq!(
            alice,
            by_credentials.identity(&headers(&[
                ("authorization", "Bearer alice"),
                ("cookie", "session=x")
            ]))
        );
        let session_x = by_credentials.identity(&headers(&[("cookie", "session=x")]));
        let session_y = by_credentials.identity(&headers(&[("cookie", "session=y")]));
        assert!(session_x.is_some());
        assert_ne!(session_x, session_y);
        assert_eq!(by_credentials.identity(&headers(&[("x-other", "1")])), None);
        // Issue 40 item 2: tenants told apart by an API key alone, or by a
        // proxy credential; every credential header present counts.
        let tenant_a = by_credentials.identity(&headers(&[("x-api-key", "key-a")]));
        let tenant_b = by_credentials.identity(&headers(&[("x-api-key", "key-b")]));
        assert!(tenant_a.is_some());
        assert_ne!(tenant_a, tenant_b);
        let proxied = by_credentials.identity(&headers(&[("proxy-authorization", "Basic a")]));
        assert!(proxied.is_some());
        assert_ne!(proxied, tenant_a);
        assert_ne!(
            by_credentials.identity(&headers(&[
                ("authorization", "Bearer alice"),
                ("x-api-key", "key-a")
            ])),
            alice,
            "an API key beside a token counts too"
        );
        // Every value counts, in order.
        let two = by_credentials.identity(&headers(&[
            ("authorization", "Bearer alice"),
            ("authorization", "Bearer mallory"),
        ]));
        assert_ne!(two, alice);
        let by_tenant = CallerScope::Headers(vec![
            HeaderName::from_static("x-tenant"),
            HeaderName::from_static("x-user"),
        ]);
        let tenant = by_tenant.identity(&headers(&[("x-tenant", "t1"), ("x-user", "u1")]));
        assert!(tenant.is_some());
        for other in [
            headers(&[("x-tenant", "t1"), ("x-user", "u2")]),
            headers(&[("x-tenant", "t1"), ("x-user", "u1"), ("x-user", "u3")]),
            headers(&[("x-tenant", "t1")]),
            headers(&[("x-tenant", "t1u1")]),
        ] {
            assert_ne!(by_tenant.identity(&other), tenant, "{other:?}");
        }
        // Credentials do not count once headers are named.
        assert_eq!(
            by_tenant.identity(&headers(&[("authorization", "Bearer alice")])),
            None
        );
        assert_eq!(
            CallerScope::Shared.identity(&headers(&[("authorization", "Bearer alice")])),
            None
        );
    }

    #[test]
    fn a_record_id_depends_on_every_part_of_the_scope() {
        let idempotency = key("\"k1\"").unwrap();
        let scope = Scope {
            method: &Method::POST,
            route: "/orders",
            caller: Some(b"Bearer alice"),
        };
        let id = scope.record_id(&idempotency);
        assert_eq!(id.len(), 64);
        assert_eq!(id, scope.record_id(&idempotency), "stable");
        let others = [
            Scope {
                method: &Method::PATCH,
                ..scope.clone()
            },
            Scope {
                route: "/orders/1",
                ..scope.clone()
            },
            Scope {
                caller: Some(b"Bearer bob"),
                ..scope.clone()
            },
            Scope {
                caller: None,
                ..scope.clone()
            },
        ];
        for other in others {
            assert_ne!(other.record_id(&idempotency), id, "{other:?}");
        }
        assert_ne!(scope.record_id(&key("\"k2\"").unwrap()), id);
        // Lengths are part of the hash: parts cannot slide into each other.
        let slid = Scope {
            route: "/order",
            caller: Some(b"sBearer alice"),
            ..scope.clone()
        };
        assert_ne!(slid.record_id(&idempotency), id);
    }

    fn json_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        headers
    }

    #[test]
    fn json_bodies_fingerprint_the_same_whatever_their_key_order_and_spacing() {
        let order =
            |body: &[u8]| fingerprint(&Method::POST, "/orders", None, &json_headers(), body, &[]);
        let a = order(br#"{"amount": 10, "currency":"EUR","items":[1,2]}"#);
        let b = order(b"{\n  \"items\" : [1, 2],\n  \"currency\": \"EUR\", \"amount\": 1e1\n}");
        assert_eq!(a, b);
        let changed = order(br#"{"amount": 11, "currency":"EUR","items":[1,2]}"#);
        assert_ne!(a, changed);
        let reordered_array = order(br#"{"amount": 10, "currency":"EUR","items":[2,1]}"#);
        assert_ne!(a, reordered_array, "array order is data");
    }

    #[test]
    fn the_fingerprint_covers_method_path_query_and_raw_bodies() {
        let plain = HeaderMap::new();
        let form = |method: &Method, path: &str, query: Option<&str>, body: &[u8]| {
            fingerprint(method, path, query, &plain, body, &[])
        };
        let body = b"amount=10&currency=EUR";
        let base = form(&Method::POST, "/orders", Some("v=1"), body);
        assert_ne!(base, form(&Method::PATCH, "/orders", Some("v=1"), body));
        assert_ne!(base, form(&Method::POST, "/orders/x", Some("v=1"), body));
        assert_ne!(base, form(&Method::POST, "/orders", Some("v=2"), body));
        assert_ne!(base, form(&Method::POST, "/orders", None, body));
        let usd = form(
            &Method::POST,
            "/orders",
            Some("v=1"),
            b"amount=10&currency=USD",
        );
        assert_ne!(base, usd);
        // Form bodies are not reordered: only JSON has a canonical form.
        let swapped = form(
            &Method::POST,
            "/orders",
            Some("v=1"),
            b"currency=EUR&amount=10",
        );
        assert_ne!(base, swapped);
        // A body that claims JSON but is not: byte for byte, no error.
        let broken = fingerprint(
            &Method::POST,
            "/orders",
            None,
            &json_headers(),
            b"{not json",
            &[],
        );
        assert_eq!(
            broken,
            fingerprint(&Method::POST, "/orders", None, &plain, b"{not json", &[])
        );
    }

    /// Issue 40 item 2: an account-selecting header named with
    /// `--fingerprint-header` makes the same key and body for another
    /// account another request; without one, fingerprints are as before.
    #[test]
    fn fingerprint_headers_join_the_fingerprint_only_when_named() {
        let account = HeaderName::from_static("stripe-account");
        let with = |value: Option<&str>| {
            let mut headers = json_headers();
            if let Some(value) = value {
                headers.insert(account.clone(), HeaderValue::from_str(value).unwrap());
            }
            headers
        };
        let print = |headers: &HeaderMap, names: &[HeaderName]| {
            fingerprint(&Method::POST, "/charges", None, headers, b"{}", names)
        };
        let named = [account.clone()];
        let (a, b, none) = (with(Some("acct_a")), with(Some("acct_b")), with(None));
        assert_ne!(print(&a, &named), print(&b, &named));
        assert_ne!(print(&a, &named), print(&none, &named));
        assert_eq!(print(&a, &named), print(&with(Some("acct_a")), &named));
        // Not named: the header does not count (the fingerprint is what it
        // was before the flag existed).
        assert_eq!(print(&a, &[]), print(&b, &[]));
        assert_eq!(print(&a, &[]), print(&none, &[]));
    }

    #[test]
    fn answers_are_kept_unless_they_say_did_not_act_or_a_gateway_lost_them() {
        let rules = ReleaseOn::default();
        let http = |code: u16| rules.http(StatusCode::from_u16(code).unwrap());
        for kept in [
            200, 201, 204, 301, 303, 304, 307, 400, 404, 422, 500, 501, 505,
        ] {
            assert_eq!(http(kept), Disposition::Keep, "{kept}");
        }
        for released in [408, 409, 425, 429] {
            assert_eq!(http(released), Disposition::Release, "{released}");
        }
        for unknown in [502, 503, 504, 101] {
            assert_eq!(http(unknown), Disposition::Unknown, "{unknown}");
        }
        // The operator's set wins: a service that answers 503 itself when
        // it sheds load, with no gateway in front.
        let rules = ReleaseOn {
            statuses: vec![StatusCode::SERVICE_UNAVAILABLE],
            grpc_codes: vec![13],
        };
        assert_eq!(
            rules.http(StatusCode::SERVICE_UNAVAILABLE),
            Disposition::Release
        );
        assert_eq!(rules.http(StatusCode::TOO_MANY_REQUESTS), Disposition::Keep);
        assert_eq!(rules.grpc(Some(13)), Disposition::Release);
        assert_eq!(rules.grpc(Some(8)), Disposition::Keep);
    }

    #[test]
    fn grpc_answers_are_kept_unless_they_say_did_not_act_or_were_cut_off() {
        let rules = ReleaseOn::default();
        // OK, UNKNOWN, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
        // PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION,
        // OUT_OF_RANGE, UNIMPLEMENTED, INTERNAL, DATA_LOSS, UNAUTHENTICATED.
        for kept in [0, 2, 3, 5, 6, 7, 8, 9, 11, 12, 13, 15, 16] {
            assert_eq!(rules.grpc(Some(kept)), Disposition::Keep, "{kept}");
        }
        // ABORTED.
        assert_eq!(rules.grpc(Some(10)), Disposition::Release);
        // CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE, and no status at all.
        for unknown in [Some(1), Some(4), Some(14), None] {
            assert_eq!(rules.grpc(unknown), Disposition::Unknown, "{unknown:?}");
        }
    }

    #[test]
    fn numbers_a_double_cannot_hold_are_fingerprinted_from_their_text() {
        let order =
            |body: &[u8]| fingerprint(&Method::POST, "/orders", None, &json_headers(), body, &[]);
        // 2^53 + 1 parses to the same double as 2^53.
        assert_ne!(
            order(br#"{"id":9007199254740993}"#),
            order(br#"{"id":9007199254740992}"#)
        );
        assert_ne!(order(b"[0.30000000000000000001]"), order(b"[0.3]"));
        // Exactly representable spellings still canonicalise together.
        assert_eq!(
            order(br#"{"id":9007199254740992}"#),
            order(br#"{"id": 9007199254740992}"#)
        );
        assert_eq!(order(b"[10, 0.5, -0, 1E2]"), order(b"[1e1,5e-1,0,100.0]"));
        // Digits inside strings are not numbers.
        assert_eq!(
            order(br#"{"b":"9007199254740993","a":1}"#),
            order(br#"{"a":1,"b":"9007199254740993"}"#)
        );
        // Nor do escaped quotes end a string early.
        assert_eq!(
            exact_numbers(br#"{"a":"\\\"9007199254740993","b":0.1}"#),
            None
        );
        assert_eq!(
            exact_numbers(br#"{"a":"\\","b":18446744073709551615}"#).unwrap(),
            br#"{"a":"\\","b":"\u0000number:18446744073709551615e0"}"#
        );
        // Big numbers still canonicalise whatever the spacing and key order,
        // and by value.
        assert_eq!(
            order(br#"{"id":9007199254740993,"n":1}"#),
            order(br#"{ "n": 1, "id": 90071992547409930e-1 }"#)
        );
    }

    #[test]
    fn only_json_numbers_are_numbers_and_huge_exponents_keep_their_text() {
        for number in [
            "0",
            "-0",
            "10",
            "1.5",
            "-1.5e-3",
            "1E+2",
            "9007199254740993",
        ] {
            assert!(is_json_number(number), "{number}");
        }
        for not_json in [
            "09", "1.", ".5", "-", "1e", "1e+", "--1", "1.2.3", "+1", "0x1",
        ] {
            assert!(!is_json_number(not_json), "{not_json}");
        }
        // Leading zeros are not JSON: the body is fingerprinted as bytes,
        // not rewritten into its valid neighbour.
        assert_eq!(exact_numbers(b"[09007199254740993]"), None);
        let order =
            |body: &[u8]| fingerprint(&Method::POST, "/orders", None, &json_headers(), body, &[]);
        assert_ne!(order(b"[09007199254740993]"), order(b"[9007199254740993]"));
        // Exponents past i64 neither panic nor collapse to zero.
        assert_eq!(decimal("1e99999999999999999999"), None);
        assert_eq!(decimal("1.5e-9223372036854775808"), None);
        assert_ne!(
            order(br#"{"x":1e99999999999999999999}"#),
            order(br#"{"x":1e-99999999999999999999}"#)
        );
        assert_ne!(
            order(b"[10e9223372036854775807]"),
            order(b"[1e-9223372036854775807]")
        );
    }

    #[test]
    fn decimals_compare_by_value() {
        assert_eq!(decimal("10"), decimal("1e1"));
        assert_eq!(decimal("100.0"), decimal("1E2"));
        assert_eq!(decimal("0.5"), decimal("5e-1"));
        assert_eq!(decimal("-0"), decimal("0.000"));
        assert_ne!(decimal("-1"), decimal("1"));
        assert_ne!(decimal("9007199254740993"), decimal("9.007199254740992e15"));
    }

    #[test]
    fn set_cookie_and_named_headers_are_never_stored() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.append(
            header::SET_COOKIE,
            HeaderValue::from_static("session=alice"),
        );
        headers.insert("x-session-token", HeaderValue::from_static("secret"));
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        let never = [HeaderName::from_static("x-session-token")];
        let kept: Vec<String> = storable(&headers, &never)
            .iter()
            .map(|(name, _)| name.to_string())
            .collect();
        assert_eq!(kept, ["content-type"]);
        assert!(storable(&headers, &[])
            .iter()
            .any(|(name, _)| name == "x-session-token"));
    }

    #[test]
    fn an_unknown_outcome_round_trips_and_old_records_still_decode() {
        let unknown = Stored::OutcomeUnknown {
            reason: "the service did not answer within 1s".into(),
        };
        assert_eq!(Stored::decode(&unknown.encode()).unwrap(), unknown);
        let bytes = unknown.encode();
        for cut in 0..bytes.len() {
            assert!(Stored::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: Some(b"{}".to_vec()),
            trailers: Vec::new(),
        };
        // A response record written before this form existed.
        assert_eq!(
            Stored::decode(&response.encode()).unwrap(),
            Stored::Response(response)
        );
    }

    #[test]
    fn hop_by_hop_headers_are_not_stored() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-trace-hop"),
        );
        headers.insert("x-trace-hop", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.append(header::SET_COOKIE, HeaderValue::from_static("a=1"));
        headers.append(header::SET_COOKIE, HeaderValue::from_static("b=2"));
        let kept: Vec<String> = end_to_end(&headers)
            .into_iter()
            .map(|(name, value)| format!("{name}: {}", value.to_str().unwrap()))
            .collect();
        assert_eq!(
            kept,
            [
                "content-type: application/json",
                "set-cookie: a=1",
                "set-cookie: b=2"
            ]
        );
    }

    #[test]
    fn a_stored_response_round_trips_and_damage_is_reported() {
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (header::SET_COOKIE, HeaderValue::from_static("a=1")),
                (header::SET_COOKIE, HeaderValue::from_static("b=2")),
            ],
            body: Some(br#"{"id":42}"#.to_vec()),
            trailers: vec![
                (
                    HeaderName::from_static("grpc-status"),
                    HeaderValue::from_static("0"),
                ),
                (
                    HeaderName::from_static("grpc-message"),
                    HeaderValue::from_static(""),
                ),
            ],
        };
        let bytes = response.encode();
        assert_eq!(StoredResponse::decode(&bytes).unwrap(), response);
        let too_large = StoredResponse {
            body: None,
            ..response.clone()
        };
        assert_eq!(
            StoredResponse::decode(&too_large.encode()).unwrap(),
            too_large
        );
        for cut in 0..bytes.len() {
            assert!(
                StoredResponse::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(StoredResponse::decode(&trailing).is_err());
        let mut other_version = bytes;
        other_version[0] = 9;
        assert!(StoredResponse::decode(&other_version).is_err());
    }

    #[test]
    fn hex_is_two_lower_case_digits_per_byte() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff, 0x10]), "000fa5ff10");
        assert_eq!(hex(&[]), "");
    }

    #[test]
    fn route_patterns_match_methods_segments_and_the_rest() {
        let post = Method::POST;
        let patch = Method::PATCH;
        let every = RoutePattern::parse("*").unwrap();
        assert!(every.matches(&post, "/anything/at/all"));
        let payments = RoutePattern::parse("post /payments/**").unwrap();
        assert_eq!(payments.method(), Some(&Method::POST));
        assert!(payments.matches(&post, "/payments"));
        assert!(payments.matches(&post, "/payments/42/refunds"));
        assert!(!payments.matches(&patch, "/payments/42"));
        assert!(!payments.matches(&post, "/paymentsx"));
        let refunds = RoutePattern::parse("/orders/*/refunds").unwrap();
        assert!(refunds.matches(&patch, "/orders/7/refunds"));
        assert!(!refunds.matches(&patch, "/orders/7/refunds/1"));
        assert!(!refunds.matches(&patch, "/orders/refunds"));
        assert!(!refunds.matches(&patch, "/orders/7/notes"));
        let exact = RoutePattern::parse("PATCH /orders").unwrap();
        assert!(exact.matches(&patch, "/orders"));
        assert!(!exact.matches(&patch, "/orders/1"));
        for bad in ["payments", "GE T /x", "/a/**/b", "P\u{e9}ST /x"] {
            assert!(RoutePattern::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
