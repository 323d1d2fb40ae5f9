//! Drawing a step's timelines: SVG (with labels, a time axis and a legend) and PNG (the same
//! lanes and colours without text, through a small encoder of our own: uncompressed
//! deflate blocks, so no image library is needed).

use super::{RankTrace, Span};

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 160.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 46.0;
const LANE: f64 = 22.0;
/// A rank's block: compute lane, communication lane, gap.
const RANK: f64 = 2.0 * LANE + 18.0;
const LEGEND: f64 = 40.0;

/// What each category is called in the legend and drawn in.
const KINDS: [(&str, &str, [u8; 3]); 6] = [
    ("forward", "forward", [0x4c, 0x78, 0xa8]),
    ("backward", "backward", [0x54, 0xa2, 0x4b]),
    ("optimizer", "optimizer step", [0xf5, 0x85, 0x18]),
    ("wait", "waiting for a collective", [0xe4, 0x57, 0x56]),
    ("all_gather", "all-gather", [0xb2, 0x79, 0xa2]),
    ("reduce", "gradient reduction", [0x9d, 0x75, 0x5d]),
];

fn colour(category: &str) -> [u8; 3] {
    KINDS
        .iter()
        .find(|k| k.0 == category)
        .map_or([0x9a, 0x9a, 0x9a], |k| k.2)
}

fn height(ranks: usize) -> f64 {
    TOP + ranks as f64 * RANK + LEGEND
}

/// The rectangles to draw: (x, y, width, height, span), outer spans first so the units
/// inside them (a layer's forward inside the root's) are drawn on top.
fn boxes(ranks: &[RankTrace], window: (f64, f64)) -> Vec<(f64, f64, f64, f64, &Span)> {
    let scale = (WIDTH - LEFT - RIGHT) / (window.1 - window.0).max(1.0);
    let mut out = Vec::new();
    for (i, r) in ranks.iter().enumerate() {
        let mut spans: Vec<&Span> = r
            .spans
            .iter()
            .filter(|s| s.end_us > window.0 && s.start_us < window.1)
            .collect();
        spans.sort_by(|a, b| (b.end_us - b.start_us).total_cmp(&(a.end_us - a.start_us)));
        for s in spans {
            let x0 = LEFT + (s.start_us.max(window.0) - window.0) * scale;
            let x1 = LEFT + (s.end_us.min(window.1) - window.0) * scale;
            // Waits are thinner, on top of the compute they interrupt.
            let (dy, h) = if s.category == "wait" {
                (LANE * 0.55, LANE * 0.45)
            } else {
                (0.0, LANE - 2.0)
            };
            let y = TOP + i as f64 * RANK + s.lane.min(1) as f64 * LANE + dy;
            out.push((x0, y, (x1 - x0).max(0.5), h, s));
        }
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The step as SVG.
pub(super) fn svg(ranks: &[RankTrace], window: (f64, f64), title: &str) -> String {
    use std::fmt::Write;
    let h = height(ranks.len());
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{WIDTH}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="18" font-size="14">{}</text>"#,
        escape(title)
    );
    // A time axis in milliseconds.
    let span_ms = (window.1 - window.0) / 1000.0;
    let tick = [
        1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
    ]
    .into_iter()
    .find(|t| span_ms / t <= 12.0)
    .unwrap_or(10000.0);
    let scale = (WIDTH - LEFT - RIGHT) / span_ms.max(1e-3);
    let bottom = TOP + ranks.len() as f64 * RANK - 14.0;
    let mut t = 0.0;
    while t <= span_ms {
        let x = LEFT + t * scale;
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{bottom}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle" fill="#555">{t} ms</text>"##,
            TOP - 8.0,
            TOP - 10.0
        );
        t += tick;
    }
    for (i, r) in ranks.iter().enumerate() {
        let y = TOP + i as f64 * RANK;
        for (lane, label) in ["compute", "communication"].iter().enumerate() {
            let _ = writeln!(
                out,
                r##"<text x="8" y="{:.1}">rank {} {label}</text>"##,
                y + lane as f64 * LANE + LANE * 0.65,
                r.rank
            );
        }
    }
    for (x, y, w, hh, s) in boxes(ranks, window) {
        let [r, g, b] = colour(&s.category);
        let _ = writeln!(
            out,
            r##"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{hh:.2}" fill="rgb({r},{g},{b})" stroke="white" stroke-width="0.3"><title>{} ({:.3} ms)</title></rect>"##,
            escape(&s.name),
            (s.end_us - s.start_us) / 1000.0
        );
    }
    let ly = h - LEGEND + 14.0;
    let mut lx = LEFT;
    for (_, label, [r, g, b]) in KINDS {
        let _ = writeln!(
            out,
            r#"<rect x="{lx}" y="{}" width="14" height="12" fill="rgb({r},{g},{b})"/><text x="{}" y="{ly}">{label}</text>"#,
            ly - 10.0,
            lx + 18.0
        );
        lx += 30.0 + label.len() as f64 * 7.0;
    }
    out.push_str("</svg>\n");
    out
}

/// The step as PNG: the lanes and the legend's colours, without text.
pub(super) fn png(ranks: &[RankTrace], window: (f64, f64)) -> Vec<u8> {
    let (w, h) = (WIDTH as usize, height(ranks.len()) as usize);
    let mut pixels = vec![255u8; w * h * 3];
    let mut fill = |x: f64, y: f64, bw: f64, bh: f64, c: [u8; 3]| {
        let (x0, x1) = (x.max(0.0) as usize, ((x + bw).ceil() as usize).min(w));
        let (y0, y1) = (y.max(0.0) as usize, ((y + bh).ceil() as usize).min(h));
        for row in y0..y1 {
            for col in x0..x1.max(x0 + 1).min(w) {
                pixels[(row * w + col) * 3..][..3].copy_from_slice(&c);
            }
        }
    };
    for i in 0..ranks.len() {
        for lane in 0..2 {
            let y = TOP + i as f64 * RANK + lane as f64 * LANE;
            fill(
                LEFT,
                y,
                WIDTH - LEFT - RIGHT,
                LANE - 2.0,
                [0xf2, 0xf2, 0xf2],
            );
        }
    }
    for (x, y, bw, bh, s) in boxes(ranks, window) {
        fill(x, y, bw, bh, colour(&s.category));
    }
    let ly = height(ranks.len()) - LEGEND + 4.0;
    for (k, (_, _, c)) in KINDS.iter().enumerate() {
        fill(LEFT + k as f64 * 60.0, ly, 40.0, 12.0, *c);
    }
    encode_png(w, h, &pixels)
}

/// An 8-bit RGB PNG of `pixels` (rows top to bottom), its zlib stream in stored blocks.
fn encode_png(w: usize, h: usize, pixels: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(h * (w * 3 + 1));
    for row in pixels.chunks(w * 3) {
        raw.push(0); // no filter
        raw.extend_from_slice(row);
    }
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65535).collect();
    for (i, b) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        let len = b.len() as u16;
        z.extend_from_slice(&len.to_le_bytes());
        z.extend_from_slice(&(!len).to_le_bytes());
        z.extend_from_slice(b);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in &raw {
        a = (a + u32::from(byte)) % 65521;
        b = (b + a) % 65521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8; 4], data: &[u8]| {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        let mut crc = crc32fast::Hasher::new();
        crc.update(kind);
        crc.update(data);
        out.extend_from_slice(&crc.finalize().to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &z);
    chunk(b"IEND", &[]);
    out
}
