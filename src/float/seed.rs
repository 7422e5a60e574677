//! The seed of a weight's stochastic rounding: [`weight_seed`], the CRC-32 ([`crc32`]) of its key,
//! so a patched weight re-materialized after an unload comes back bit-identical.

const fn crc32_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC32_TABLE: [u32; 256] = crc32_table();

/// CRC-32 (IEEE 802.3, reflected polynomial `0xEDB88320`; the zlib/PNG/`binascii.crc32` one) of
/// `bytes`. Table-driven, one table lookup per byte.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c = CRC32_TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

/// The stochastic-rounding seed of a weight: the CRC-32 of its key's UTF-8 bytes
/// (`"a"` → 3904355907, `""` → 0).
pub fn weight_seed(key: &str) -> u64 {
    u64::from(crc32(key.as_bytes()))
}
