//! C1 one-sided read: a read writes exactly the requested elements of one whole publication into
//! the caller's destination and returns that publication's version.

use tokio::task::JoinHandle;

use super::{
    assert_describes, bits, join, must_publish, must_read_bytes, must_read_f32, ramp,
    register_published, ship, Pair,
};
use crate::{codec, Dtype, PublishedRegion, RegionKind};

/// C1: reads of several ranges, into raw bytes and into decoded `f32`, return the elements last
/// published (distinct per element, so an offset error shows) with their version; a handle
/// describes its registration; a publication replaces contents and version, also for readers of a
/// handle taken before it; a republication keeps the contents under the new version.
pub async fn read_returns_published_contents_c1(pair: Pair) {
    const LEN: usize = 37;
    let b = pair.reader.backend();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let size = dtype.size();
        let first = ramp(dtype, LEN, 0.5);
        let initial = codec::encode(dtype, &first);
        let region = register_published(&pair, dtype, initial.clone(), 7);
        let handle = ship(&region.handle());
        assert_describes(b, &handle, RegionKind::Published, LEN, 7);
        assert_eq!(handle.dtype, dtype, "{b}: handle dtype");
        assert_eq!(handle.elements(), LEN, "{b}: handle elements");
        assert_eq!(region.version(), 7, "{b}: version after registration");

        for range in [0..LEN, 3..11, 36..37, 0..1, 20..33] {
            let (version, got) = must_read_bytes(&pair, &handle, range.clone()).await;
            assert_eq!(version, 7, "{b}: {dtype:?} byte read of {range:?}: version");
            assert_eq!(
                got,
                initial[range.start * size..range.end * size],
                "{b}: {dtype:?} byte read of {range:?}"
            );
            let (version, got) = must_read_f32(&pair, &handle, range.clone()).await;
            assert_eq!(version, 7, "{b}: {dtype:?} f32 read of {range:?}: version");
            assert_eq!(
                bits(&got),
                bits(&first[range.clone()]),
                "{b}: {dtype:?} f32 read of {range:?}"
            );
        }

        let second = ramp(dtype, LEN, -0.25);
        let published = codec::encode(dtype, &second);
        must_publish(b, region.as_ref(), 8, published.clone());
        assert_eq!(region.version(), 8, "{b}: version after publish");
        assert_eq!(
            ship(&region.handle()).version,
            8,
            "{b}: a handle taken after publish carries the new version"
        );
        // The handle taken before the publication reads the current one.
        let (version, got) = must_read_bytes(&pair, &handle, 0..LEN).await;
        assert_eq!(version, 8, "{b}: {dtype:?} version read after publish");
        assert_eq!(got, published, "{b}: {dtype:?} bytes read after publish");
        let (version, got) = must_read_f32(&pair, &handle, 5..LEN).await;
        assert_eq!(version, 8, "{b}: {dtype:?} version read after publish");
        assert_eq!(
            bits(&got),
            bits(&second[5..]),
            "{b}: {dtype:?} values read after publish"
        );

        // Published again without bytes: the same contents as the new version.
        region
            .republish(9)
            .unwrap_or_else(|e| panic!("{b}: {dtype:?} republish: {e}"));
        assert_eq!(region.version(), 9, "{b}: version after republish");
        let (version, got) = must_read_bytes(&pair, &handle, 0..LEN).await;
        assert_eq!(version, 9, "{b}: {dtype:?} version read after republish");
        assert_eq!(got, published, "{b}: {dtype:?} bytes read after republish");
    }
}

/// C1: an f32 region returns its bytes unchanged and decodes bit for bit, special values included
/// (signed zero, subnormals, infinities, NaN payloads).
pub async fn f32_reads_are_bit_exact_c1(pair: Pair) {
    let b = pair.reader.backend();
    let values = [
        0.0,
        -0.0,
        f32::MIN_POSITIVE / 4.0,
        -f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(0xffa0_0001),
        0.1,
        -1.0e-30,
    ];
    let bytes = codec::encode_f32(&values);
    let region = register_published(&pair, Dtype::F32, bytes.clone(), 1);
    let handle = ship(&region.handle());
    let (_, got) = must_read_bytes(&pair, &handle, 0..values.len()).await;
    assert_eq!(got, bytes, "{b}: f32 bytes read back bit for bit");
    let (_, got) = must_read_f32(&pair, &handle, 0..values.len()).await;
    assert_eq!(
        bits(&got),
        bits(&values),
        "{b}: f32 values read bit for bit"
    );
}

/// C1: a bf16 region returns exactly the bytes its owner published, and an `f32` destination
/// receives the owner's fp32 values rounded to nearest, ties to even ([`codec::round_trip`]),
/// widened exactly.
pub async fn bf16_reads_round_to_nearest_even_c1(pair: Pair) {
    let b = pair.reader.backend();
    let ulp = 2f32.powi(-7); // bf16 spacing in [1, 2)
    let tie = ulp / 2.0;
    let cases: [(f32, f32); 7] = [
        (1.0 + tie, 1.0),
        (1.0 + 3.0 * tie, 1.0 + 2.0 * ulp),
        (1.0 + tie + 2f32.powi(-20), 1.0 + ulp),
        (-(1.0 + tie), -1.0),
        (1.0e-3, 131.0 / 128.0 * 2f32.powi(-10)),
        (3.0, 3.0),
        (-0.0, -0.0),
    ];
    let inputs: Vec<f32> = cases.iter().map(|(x, _)| *x).collect();
    let bytes = codec::encode(Dtype::Bf16, &inputs);
    let region = register_published(&pair, Dtype::Bf16, bytes.clone(), 1);
    let handle = ship(&region.handle());
    let (_, got) = must_read_bytes(&pair, &handle, 0..cases.len()).await;
    assert_eq!(got, bytes, "{b}: bf16 bytes read back bit for bit");
    let (_, decoded) = must_read_f32(&pair, &handle, 0..cases.len()).await;
    for ((x, expected), got) in cases.iter().zip(&decoded) {
        assert_eq!(
            got.to_bits(),
            expected.to_bits(),
            "{b}: bf16 read of {x:e} is {got:e}, expected {expected:e}"
        );
    }
}

/// C1: while the owner publishes versions 1..=64 of a 256 KiB f32 region (element `i` of version
/// `v` is `v * LEN + i`, exact in f32), concurrent readers of the whole region and of parts of it,
/// into bytes and into `f32`, only ever see elements of the version they are told, at the right
/// offsets, and each reader sees versions in order, up to the last.
pub async fn read_sees_whole_publication_c1(pair: Pair) {
    const LEN: usize = 1 << 16;
    const LAST: u64 = 64;
    const READERS: usize = 4;
    let b = pair.reader.backend();
    let contents = |version: u64| -> Vec<f32> {
        (0..LEN)
            .map(|i| (version as usize * LEN + i) as f32)
            .collect()
    };
    let region = register_published(&pair, Dtype::F32, codec::encode_f32(&contents(0)), 0);
    let handle = ship(&region.handle());

    let readers: Vec<JoinHandle<()>> = (0..READERS)
        .map(|reader| {
            let pair = pair.clone();
            let handle = handle.clone();
            // Reader 0 reads the whole region; the others read a different part each.
            let range = if reader == 0 {
                0..LEN
            } else {
                (reader - 1) * LEN / 3 + 1..reader * LEN / 3
            };
            tokio::spawn(async move {
                let mut last_version = 0;
                for read in 0usize.. {
                    let (version, values) = if read % 2 == 0 {
                        must_read_f32(&pair, &handle, range.clone()).await
                    } else {
                        let (version, raw) = must_read_bytes(&pair, &handle, range.clone()).await;
                        (version, codec::decode_f32(&raw).unwrap_or_default())
                    };
                    assert!(
                        version >= last_version,
                        "{b}: reader {reader} saw version {version} after version {last_version}"
                    );
                    last_version = version;
                    assert_eq!(values.len(), range.len(), "{b}: reader {reader} length");
                    let base = version as usize * LEN + range.start;
                    if let Some((i, v)) = values
                        .iter()
                        .enumerate()
                        .find(|(i, v)| **v != (base + i) as f32)
                    {
                        panic!(
                            "{b}: reader {reader} read version {version} but element {} is {v}, \
                             expected {} (a torn read mixing two publications, or a wrong offset)",
                            range.start + i,
                            base + i
                        );
                    }
                    if version == LAST {
                        return;
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();

    let writer = tokio::task::spawn_blocking(move || {
        for version in 1..=LAST {
            if let Err(e) = region.publish(version, codec::encode_f32(&contents(version))) {
                panic!("{b}: publish of version {version} failed: {e}");
            }
            std::thread::yield_now();
        }
        region
    });
    // Keep the region registered until every reader has seen the last version.
    let region: Box<dyn PublishedRegion> = join(writer).await;
    for reader in readers {
        join(reader).await;
    }
    assert_eq!(region.version(), LAST, "{b}: final version");
}
