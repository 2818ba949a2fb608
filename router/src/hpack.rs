//! HPACK (RFC 7541), as much as the UNIX socket's authority fix needs: a decoder that follows
//! a client's dynamic table, and a plain encoder for what goes on to h2.
//!
//! Written here rather than taken from fluke-hpack, whose decoder built its Huffman table (a
//! nested HashMap of 257 codes) anew for every Huffman-coded string: 44% of the front door's
//! time on a rewritten connection (bench/RESULTS.md, "The front door over its UNIX socket").
//! HPACK's Huffman code is canonical (each code follows from the code lengths alone, RFC 7541
//! Appendix B), so decoding needs only the lengths and three small tables computed at compile
//! time, and reads a symbol in one comparison per code length instead of one lookup per bit.
//! Malformed input is an error value, never a panic: the block comes from a client.

use std::collections::VecDeque;

/// Why a header block could not be read; the connection it came on ends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HpackError(pub &'static str);

/// RFC 7541 Appendix A: indexes 1 to 61.
const STATIC_TABLE: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// RFC 7541 Appendix B: the code length of each symbol, 0 to 255 and EOS (256).
const CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, //
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28, //
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, //
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, //
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, //
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, //
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, //
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, //
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, //
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, //
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, //
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, //
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, //
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, //
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, //
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, //
    30,
];

const EOS: u16 = 256;
/// A decoder's string buffers larger than this are not kept past the block that grew them.
const KEPT_BUFFER: usize = 4 << 10;
const SHORTEST: usize = 5;
const LONGEST: usize = 30;

/// The canonical code, from the lengths: codes of one length are consecutive numbers, in the
/// order of their symbols, and every code of a length is below (left-justified) every code
/// of a longer one.
struct Canonical {
    /// The first code of each length.
    first: [u32; LONGEST + 1],
    /// Where each length's symbols start in `symbols`.
    offset: [u16; LONGEST + 1],
    /// Past the last code of each length and every shorter one, left-justified in 32 bits: a
    /// code's length is the first whose limit is above the next 32 bits read.
    limit: [u64; LONGEST + 1],
    /// The symbols ordered by (code length, symbol).
    symbols: [u16; 257],
}

const CANONICAL: Canonical = canonical();

const fn canonical() -> Canonical {
    let mut count = [0u32; LONGEST + 1];
    let mut symbol = 0;
    while symbol < 257 {
        count[CODE_LENGTHS[symbol] as usize] += 1;
        symbol += 1;
    }
    let mut table = Canonical {
        first: [0; LONGEST + 1],
        offset: [0; LONGEST + 1],
        limit: [0; LONGEST + 1],
        symbols: [0; 257],
    };
    let mut code = 0u32;
    let mut start = 0u16;
    let mut len = 1;
    while len <= LONGEST {
        table.first[len] = code;
        table.offset[len] = start;
        table.limit[len] = ((code + count[len]) as u64) << (32 - len);
        start += count[len] as u16;
        code = (code + count[len]) << 1;
        len += 1;
    }
    let mut next = table.offset;
    symbol = 0;
    while symbol < 257 {
        let len = CODE_LENGTHS[symbol] as usize;
        table.symbols[next[len] as usize] = symbol as u16;
        next[len] += 1;
        symbol += 1;
    }
    table
}

/// `src` Huffman-decoded onto the end of `out`. The padding after the last symbol must be
/// fewer than 8 bits, all ones (the start of EOS); EOS itself is an error (RFC 7541 5.2).
pub fn huffman_decode(src: &[u8], out: &mut Vec<u8>) -> Result<(), HpackError> {
    let table = &CANONICAL;
    let mut bytes = src.iter();
    // The bits not decoded yet, in the low `held` bits.
    let mut bits: u64 = 0;
    let mut held: usize = 0;
    loop {
        while held <= 56 {
            let Some(&byte) = bytes.next() else { break };
            bits = bits << 8 | u64::from(byte);
            held += 8;
        }
        if held == 0 {
            return Ok(());
        }
        // The next 32 bits, the end filled with ones as the padding is.
        let next = if held >= 32 {
            (bits >> (held - 32)) as u32
        } else {
            ((bits << (32 - held)) as u32) | (u32::MAX >> held)
        };
        let mut len = SHORTEST;
        while u64::from(next) >= table.limit[len] {
            len += 1;
            if len > LONGEST {
                // Unreachable with a complete code (EOS is all ones), kept as an error.
                return Err(HpackError("a Huffman string with no code"));
            }
        }
        if len > held {
            // What is left is no whole code: the padding, which is fewer than 8 ones.
            let ones = (1u64 << held) - 1;
            return if held < 8 && bits & ones == ones {
                Ok(())
            } else {
                Err(HpackError("a Huffman string's padding is not under 8 ones"))
            };
        }
        let rank = (next >> (32 - len)) - table.first[len];
        let symbol = table.symbols[usize::from(table.offset[len]) + rank as usize];
        if symbol == EOS {
            return Err(HpackError("a Huffman string holds EOS"));
        }
        out.push(symbol as u8);
        held -= len;
        bits &= (1u64 << held) - 1;
    }
}

/// An integer with an `n`-bit prefix (RFC 7541 5.1), from `block` at `*at`. Anything past what
/// a header block can need (2^28) is refused rather than wrapped.
fn integer(block: &[u8], at: &mut usize, n: u32) -> Result<usize, HpackError> {
    let first = *block
        .get(*at)
        .ok_or(HpackError("a header block ends in an integer"))?;
    *at += 1;
    let mask = (1u8 << n) - 1;
    let mut value = usize::from(first & mask);
    if value < usize::from(mask) {
        return Ok(value);
    }
    let mut shift = 0;
    loop {
        let byte = *block
            .get(*at)
            .ok_or(HpackError("a header block ends in an integer"))?;
        *at += 1;
        value += usize::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
        shift += 7;
        if shift > 21 {
            return Err(HpackError("an integer too large for a header block"));
        }
    }
}

/// A string literal (RFC 7541 5.2): its raw octets borrowed from the block, or Huffman-decoded
/// into `scratch`.
fn string<'a>(
    block: &'a [u8],
    at: &mut usize,
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8], HpackError> {
    let huffman = block.get(*at).is_some_and(|b| b & 0x80 != 0);
    let len = integer(block, at, 7)?;
    let end = at
        .checked_add(len)
        .filter(|&end| end <= block.len())
        .ok_or(HpackError("a string longer than its header block"))?;
    let raw = &block[*at..end];
    *at = end;
    if !huffman {
        return Ok(raw);
    }
    scratch.clear();
    huffman_decode(raw, scratch)?;
    Ok(scratch)
}

/// One decoded field. `sensitive`: sent "never indexed", which a re-encoding must keep (RFC
/// 7541 6.2.3).
pub struct Field<'a> {
    pub name: &'a [u8],
    pub value: &'a [u8],
    pub sensitive: bool,
}

/// A dynamic table entry: a name and its value.
type Entry = (Box<[u8]>, Box<[u8]>);

/// The decoding side of one connection's HPACK state: the dynamic table its client's encoder
/// fills, newest entry first.
pub struct Decoder {
    table: VecDeque<Entry>,
    /// The table's size as HPACK counts it (each entry's name and value plus 32).
    size: usize,
    /// The size the client's last size update set (at first the most allowed).
    max_size: usize,
    /// The most a size update may set: the SETTINGS_HEADER_TABLE_SIZE the client was told.
    allowed: usize,
    name: Vec<u8>,
    value: Vec<u8>,
}

impl Decoder {
    pub fn new(allowed: usize) -> Decoder {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max_size: allowed,
            allowed,
            name: Vec::new(),
            value: Vec::new(),
        }
    }

    /// Each field of `block` in order, to `each`; an error from `each` ends the decoding with
    /// it (a caller's bound on the list). After any error this decoder's table no longer
    /// follows the client's: its connection must end.
    pub fn decode<E: From<HpackError>>(
        &mut self,
        block: &[u8],
        mut each: impl FnMut(Field<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut at = 0;
        let mut fields_seen = false;
        while let Some(&first) = block.get(at) {
            if first & 0x80 != 0 {
                let index = integer(block, &mut at, 7)?;
                let (name, value) = self.entry(index)?;
                each(Field {
                    name,
                    value,
                    sensitive: false,
                })?;
                fields_seen = true;
            } else if first & 0xe0 == 0x20 {
                // A size update belongs at the start of a block (RFC 7541 4.2); h2 refuses
                // one anywhere else, and the re-encoded block carries none for it to see.
                if fields_seen {
                    return Err(HpackError("a table size update after a header field").into());
                }
                let size = integer(block, &mut at, 5)?;
                if size > self.allowed {
                    return Err(HpackError("a table size update past the size allowed").into());
                }
                self.max_size = size;
                self.evict_to(size);
            } else {
                let (prefix, indexing, sensitive) = match first & 0xf0 {
                    _ if first & 0x40 != 0 => (6, true, false),
                    0x10 => (4, false, true),
                    _ => (4, false, false),
                };
                let index = integer(block, &mut at, prefix)?;
                let mut name = std::mem::take(&mut self.name);
                let mut value = std::mem::take(&mut self.value);
                let decoded = self.literal(block, &mut at, index, &mut name, &mut value);
                let result = match decoded {
                    Ok(value_slice) => {
                        let outcome = each(Field {
                            name: &name,
                            value: value_slice,
                            sensitive,
                        });
                        if outcome.is_ok() && indexing {
                            let entry = (name.as_slice().into(), value_slice.into());
                            self.insert(entry);
                        }
                        outcome
                    }
                    Err(error) => Err(error.into()),
                };
                self.name = name;
                self.value = value;
                result?;
                fields_seen = true;
            }
        }
        // A connection lives long; one large string should not keep its buffer with it.
        for buffer in [&mut self.name, &mut self.value] {
            if buffer.capacity() > KEPT_BUFFER {
                *buffer = Vec::new();
            }
        }
        Ok(())
    }

    /// A literal field's name (into `name`) and value (borrowed from the block or decoded
    /// into `value`).
    fn literal<'a>(
        &self,
        block: &'a [u8],
        at: &mut usize,
        index: usize,
        name: &mut Vec<u8>,
        value: &'a mut Vec<u8>,
    ) -> Result<&'a [u8], HpackError> {
        name.clear();
        if index == 0 {
            let mut scratch = Vec::new();
            let literal = string(block, at, &mut scratch)?;
            name.extend_from_slice(literal);
        } else {
            name.extend_from_slice(self.entry(index)?.0);
        }
        string(block, at, value)
    }

    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        if let Some(&(name, value)) = index.checked_sub(1).and_then(|i| STATIC_TABLE.get(i)) {
            return Ok((name, value));
        }
        index
            .checked_sub(STATIC_TABLE.len() + 1)
            .and_then(|i| self.table.get(i))
            .map(|(name, value)| (&name[..], &value[..]))
            .ok_or(HpackError("a header field index past the tables"))
    }

    /// RFC 7541 4.4: an entry larger than the table empties it and is not kept.
    fn insert(&mut self, entry: Entry) {
        let size = entry.0.len() + entry.1.len() + 32;
        if size > self.max_size {
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max_size - size);
        self.size += size;
        self.table.push_front(entry);
    }

    fn evict_to(&mut self, size: usize) {
        while self.size > size {
            let Some((name, value)) = self.table.pop_back() else {
                self.size = 0;
                return;
            };
            self.size -= name.len() + value.len() + 32;
        }
    }
}

/// Appends `value` with an `n`-bit prefix whose other bits are `flags` (RFC 7541 5.1).
fn put_integer(out: &mut Vec<u8>, flags: u8, n: u32, mut value: usize) {
    let mask = (1usize << n) - 1;
    if value < mask {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | mask as u8);
    value -= mask;
    while value >= 0x80 {
        out.push(0x80 | (value & 0x7f) as u8);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_string(out: &mut Vec<u8>, bytes: &[u8]) {
    put_integer(out, 0, 7, bytes.len());
    out.extend_from_slice(bytes);
}

/// `field` appended to `out` without the dynamic table (so the reader's table stays empty and
/// nothing of it has to be followed): a static entry by its index, else a literal "without
/// indexing" (or "never indexed", as it came) naming a static name by index. No Huffman: the
/// bytes stay on this host. A field takes at most 9 bytes above its name and value (each
/// length under 2^21).
pub fn encode_plain(field: &Field<'_>, out: &mut Vec<u8>) {
    let flags = if field.sensitive { 0x10 } else { 0x00 };
    let mut name_index = 0;
    for (i, &(name, value)) in STATIC_TABLE.iter().enumerate() {
        if name == field.name {
            if value == field.value && !field.sensitive {
                put_integer(out, 0x80, 7, i + 1);
                return;
            }
            if name_index == 0 {
                name_index = i + 1;
            }
        }
    }
    put_integer(out, flags, 4, name_index);
    if name_index == 0 {
        put_string(out, field.name);
    }
    put_string(out, field.value);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(text: &str) -> Vec<u8> {
        let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap(), 16).unwrap())
            .collect()
    }

    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    fn decode(decoder: &mut Decoder, block: &[u8]) -> Result<Fields, HpackError> {
        let mut fields = Vec::new();
        decoder.decode(block, |f: Field<'_>| {
            fields.push((f.name.to_vec(), f.value.to_vec()));
            Ok::<(), HpackError>(())
        })?;
        Ok(fields)
    }

    fn pairs(list: &[(&str, &str)]) -> Fields {
        list.iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    fn table(decoder: &Decoder) -> Vec<(String, String)> {
        decoder
            .table
            .iter()
            .map(|(n, v)| {
                (
                    String::from_utf8_lossy(n).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                )
            })
            .collect()
    }

    /// The code of each symbol, from the canonical tables.
    fn code(symbol: usize) -> (u32, usize) {
        let table = &CANONICAL;
        let len = usize::from(CODE_LENGTHS[symbol]);
        let start = usize::from(table.offset[len]);
        let rank = table.symbols[start..]
            .iter()
            .position(|&s| usize::from(s) == symbol)
            .unwrap();
        (table.first[len] + rank as u32, len)
    }

    fn huffman_encode(bytes: &[u8]) -> Vec<u8> {
        let (mut bits, mut held, mut out) = (0u64, 0usize, Vec::new());
        for &b in bytes {
            let (c, len) = code(usize::from(b));
            bits = bits << len | u64::from(c);
            held += len;
            while held >= 8 {
                out.push((bits >> (held - 8)) as u8);
                held -= 8;
                bits &= (1 << held) - 1;
            }
        }
        if held > 0 {
            out.push((bits << (8 - held)) as u8 | (0xff >> held));
        }
        out
    }

    #[test]
    fn the_canonical_codes_are_the_rfcs() {
        // RFC 7541 Appendix B, a few rows of each length class.
        for (symbol, expected) in [
            (0usize, (0x1ff8, 13)),
            (1, (0x7fffd8, 23)),
            (b' ' as usize, (0x14, 6)),
            (b'%' as usize, (0x15, 6)),
            (b'0' as usize, (0x0, 5)),
            (b'a' as usize, (0x3, 5)),
            (b'z' as usize, (0x7b, 7)),
            (b'{' as usize, (0x7ffe, 15)),
            (b'~' as usize, (0x1ffd, 13)),
            (127, (0xffffffc, 28)),
            (128, (0xfffe6, 20)),
            (200, (0x3ffffe2, 26)),
            (254, (0x7fffff0, 27)),
            (255, (0x3ffffee, 26)),
            (256, (0x3fffffff, 30)),
        ] {
            assert_eq!(code(symbol), expected, "symbol {symbol}");
        }
    }

    #[test]
    fn every_symbol_decodes_to_itself_and_fluke_hpack_agrees() {
        for symbol in 0..=255u8 {
            let encoded = huffman_encode(&[symbol, b'a', symbol]);
            let mut out = Vec::new();
            huffman_decode(&encoded, &mut out).unwrap();
            assert_eq!(out, [symbol, b'a', symbol]);
            let theirs = fluke_hpack::huffman::HuffmanDecoder::new().decode(&encoded);
            assert_eq!(theirs.unwrap(), out, "symbol {symbol}");
        }
        let all: Vec<u8> = (0..=255).chain((0..=255).rev()).collect();
        let mut out = Vec::new();
        huffman_decode(&huffman_encode(&all), &mut out).unwrap();
        assert_eq!(out, all);
    }

    #[test]
    fn huffman_strings_from_rfc_7541_appendix_c() {
        for (encoded, text) in [
            ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
            ("a8eb 1064 9cbf", "no-cache"),
            ("25a8 49e9 5ba9 7d7f", "custom-key"),
            ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
            ("6402", "302"),
            ("aec3 771a 4b", "private"),
            (
                "d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff",
                "Mon, 21 Oct 2013 20:13:21 GMT",
            ),
            (
                "9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3",
                "https://www.example.com",
            ),
            ("", ""),
        ] {
            let mut out = Vec::new();
            huffman_decode(&hex(encoded), &mut out).unwrap();
            assert_eq!(out, text.as_bytes());
            assert_eq!(huffman_encode(text.as_bytes()), hex(encoded), "{text}");
        }
    }

    #[test]
    fn bad_huffman_padding_and_eos_are_errors() {
        let mut out = Vec::new();
        // "0" is 00000: padded with ones it is 0x07; with zeros, the padding is wrong.
        assert!(huffman_decode(&[0x07], &mut out).is_ok());
        assert!(
            huffman_decode(&[0x00], &mut out).is_err(),
            "padding of zeros"
        );
        // A whole byte of ones after a symbol: padding of 8 bits or more.
        assert!(huffman_decode(&[0x07, 0xff], &mut out).is_err());
        assert!(huffman_decode(&[0xff], &mut out).is_err());
        // EOS (30 ones) encoded in full, then padding.
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xff], &mut out),
            Err(HpackError("a Huffman string holds EOS"))
        );
        for len in 0..64 {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let ours = huffman_decode(&bytes, &mut Vec::new());
            let theirs = fluke_hpack::huffman::HuffmanDecoder::new().decode(&bytes);
            assert_eq!(ours.is_ok(), theirs.is_ok(), "{bytes:?}");
        }
    }

    #[test]
    fn requests_without_huffman_rfc_7541_c3() {
        let mut decoder = Decoder::new(4096);
        let first = hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d");
        assert_eq!(
            decode(&mut decoder, &first).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ])
        );
        assert_eq!(decoder.size, 57);
        let second = hex("8286 84be 5808 6e6f 2d63 6163 6865");
        assert_eq!(
            decode(&mut decoder, &second).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ])
        );
        let third = hex("8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65");
        assert_eq!(
            decode(&mut decoder, &third).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
        assert_eq!(
            table(&decoder),
            [
                ("custom-key".into(), "custom-value".into()),
                ("cache-control".into(), "no-cache".into()),
                (":authority".into(), "www.example.com".into()),
            ]
        );
        assert_eq!(decoder.size, 164);
    }

    #[test]
    fn responses_with_huffman_and_eviction_rfc_7541_c6() {
        let mut decoder = Decoder::new(4096);
        decoder.max_size = 256; // C.5/C.6 run with a 256-octet table
        let first = hex(
            "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
             2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
        );
        assert_eq!(
            decode(&mut decoder, &first).unwrap(),
            pairs(&[
                (":status", "302"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com"),
            ])
        );
        assert_eq!(decoder.size, 222);
        let second = hex("4883 640e ffc1 c0bf");
        assert_eq!(
            decode(&mut decoder, &second).unwrap(),
            pairs(&[
                (":status", "307"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com"),
            ])
        );
        assert_eq!(decoder.size, 222);
        let third = hex(
            "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
             77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
             9587 3160 65c0 03ed 4ee5 b106 3d50 07",
        );
        assert_eq!(
            decode(&mut decoder, &third).unwrap(),
            pairs(&[
                (":status", "200"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:22 GMT"),
                ("location", "https://www.example.com"),
                ("content-encoding", "gzip"),
                (
                    "set-cookie",
                    "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
                ),
            ])
        );
        assert_eq!(
            table(&decoder),
            [
                (
                    "set-cookie".into(),
                    "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1".into()
                ),
                ("content-encoding".into(), "gzip".into()),
                ("date".into(), "Mon, 21 Oct 2013 20:13:22 GMT".into()),
            ]
        );
        assert_eq!(decoder.size, 215);
    }

    #[test]
    fn size_updates_evict_and_are_bounded_and_placed() {
        let mut decoder = Decoder::new(4096);
        // custom-key: custom-value, indexed (C.2.1).
        let literal = hex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572");
        decode(&mut decoder, &literal).unwrap();
        assert_eq!(decoder.table.len(), 1);
        // A size update to 0 empties the table; the entry's index is then past the tables.
        decode(&mut decoder, &[0x20]).unwrap();
        assert!(decoder.table.is_empty());
        assert!(decode(&mut decoder, &[0xbe]).is_err());
        // Back to 4096 (0x3f e1 1f), then an entry again.
        decode(&mut decoder, &[0x3f, 0xe1, 0x1f]).unwrap();
        decode(&mut decoder, &literal).unwrap();
        assert_eq!(decode(&mut decoder, &[0xbe]).unwrap()[0].0, b"custom-key");
        // 4097: past what the client was told.
        assert!(decode(&mut decoder, &[0x3f, 0xe2, 0x1f]).is_err());
        // After a field, not at the start.
        assert!(decode(&mut Decoder::new(4096), &[0x82, 0x20]).is_err());
        // An entry larger than the table empties it and is not kept.
        let mut small = Decoder::new(4096);
        decode(&mut small, &[0x3f, 0x11]).unwrap(); // 48
        decode(&mut small, &literal).unwrap(); // 10 + 13 + 32 = 55 > 48
        assert!(small.table.is_empty() && small.size == 0);
    }

    #[test]
    fn malformed_blocks_are_errors_never_panics() {
        for block in [
            &[0x80][..],                           // index 0
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0x0f], // an integer past the bound
            &[0xff],                               // ends in an integer
            &[0x41],                               // ends before the value's length
            &[0x41, 0x05, b'a'],                   // a value longer than the block
            &[0x40, 0x81],                         // a Huffman name that ends too soon
            &[0xc0],                               // index 64, an empty dynamic table
        ] {
            assert!(
                decode(&mut Decoder::new(4096), block).is_err(),
                "{block:02x?}"
            );
        }
        // Every short block, against fluke-hpack: both read it alike or both refuse it, but
        // for two rules where they differ: fluke-hpack refuses a block that ends in a size
        // update (RFC 7541 allows it, h2 takes it), this decoder one that follows a field
        // (RFC 7541 4.2 puts it at the start; h2 refuses it there too).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 12) as usize;
            let block: Vec<u8> = (0..len).map(|i| (state >> (i * 5)) as u8).collect();
            let ours = decode(&mut Decoder::new(4096), &block);
            let theirs = std::panic::catch_unwind(|| {
                let mut decoder = fluke_hpack::Decoder::new();
                decoder.set_max_allowed_table_size(4096);
                decoder.decode(&block)
            });
            if let Ok(theirs) = theirs {
                match (&ours, &theirs) {
                    (Ok(a), Ok(b)) => assert_eq!(a, b, "{block:02x?}"),
                    (Err(_), Err(_)) => {}
                    (Ok(_), Err(fluke_hpack::decoder::DecoderError::SizeUpdateAtEnd)) => {}
                    (Err(HpackError("a table size update after a header field")), Ok(_)) => {}
                    _ => panic!("{block:02x?}: ours {ours:?}, fluke-hpack {theirs:?}"),
                }
            }
        }
    }

    #[test]
    fn a_callers_error_stops_the_decoding() {
        let block = hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d");
        let mut seen = 0;
        let result = Decoder::new(4096).decode(&block, |_: Field<'_>| {
            seen += 1;
            if seen == 2 {
                Err(HpackError("enough"))
            } else {
                Ok(())
            }
        });
        assert_eq!(result, Err(HpackError("enough")));
        assert_eq!(seen, 2);
    }

    #[test]
    fn the_plain_encoding_decodes_to_the_same_fields_and_fills_no_table() {
        let fields = [
            (&b":method"[..], &b"POST"[..], false),
            (b":scheme", b"http", false),
            (
                b":path",
                b"/tensorflow.serving.PredictionService/Predict",
                false,
            ),
            (b":authority", b"localhost", false),
            (b"content-type", b"application/grpc", false),
            (b"te", b"trailers", false),
            (b"authorization", b"Bearer secret", true),
            (b"x-long", &[b'v'; 300][..], false),
            (b":authority", b"", false),
        ];
        let mut block = Vec::new();
        for &(name, value, sensitive) in &fields {
            encode_plain(
                &Field {
                    name,
                    value,
                    sensitive,
                },
                &mut block,
            );
        }
        let expected: Fields = fields
            .iter()
            .map(|&(n, v, _)| (n.to_vec(), v.to_vec()))
            .collect();
        let mut ours = Decoder::new(4096);
        assert_eq!(decode(&mut ours, &block).unwrap(), expected);
        assert!(ours.table.is_empty(), "nothing indexed");
        let mut theirs = fluke_hpack::Decoder::new();
        assert_eq!(theirs.decode(&block).unwrap(), expected);
        // The sensitive one is sent never-indexed (0x1_ with authorization's index 23).
        assert!(block.windows(2).any(|w| w == [0x1f, 0x08]));
        // :method POST and :scheme http by their static indexes.
        assert_eq!(&block[..2], &[0x83, 0x86]);
    }
}
