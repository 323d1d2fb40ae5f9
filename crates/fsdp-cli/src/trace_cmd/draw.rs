//! Drawing a step's timelines: one list of shapes (the lanes' boxes, the title, a time axis,
//! lane names and a legend) rendered as SVG or as a PNG with the same text (Noto Sans Mono
//! glyphs pre-rasterised at 16 px, blended into the pixels; compressed by the `png` crate).

use noto_sans_mono_bitmap::{FontWeight, RasterHeight, get_raster, get_raster_width};

use super::{RankTrace, Span};

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 160.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 46.0;
const LANE: f64 = 22.0;
/// A rank's block: compute lane, communication lane, gap.
const RANK: f64 = 2.0 * LANE + 18.0;
const LEGEND: f64 = 40.0;
/// One character's advance in the PNG's font (and the legend's spacing in both).
const CHAR: f64 = 7.0;

/// What each category is called in the legend and drawn in.
const KINDS: [(&str, &str, [u8; 3]); 7] = [
    ("forward", "forward", [0x4c, 0x78, 0xa8]),
    ("backward", "backward", [0x54, 0xa2, 0x4b]),
    ("refill", "refilling parameters", [0x9c, 0xd0, 0x8f]),
    ("optimizer", "optimizer step", [0xf5, 0x85, 0x18]),
    ("wait", "waiting for a collective", [0xe4, 0x57, 0x56]),
    ("all_gather", "all-gather", [0xb2, 0x79, 0xa2]),
    ("reduce", "gradient reduction", [0x9d, 0x75, 0x5d]),
];

const BLACK: [u8; 3] = [0, 0, 0];
const GREY: [u8; 3] = [0x55, 0x55, 0x55];
const GRID: [u8; 3] = [0xdd, 0xdd, 0xdd];
const LANE_BACKGROUND: [u8; 3] = [0xf2, 0xf2, 0xf2];

fn colour(category: &str) -> [u8; 3] {
    KINDS
        .iter()
        .find(|k| k.0 == category)
        .map_or([0x9a, 0x9a, 0x9a], |k| k.2)
}

fn height(ranks: usize) -> f64 {
    TOP + ranks as f64 * RANK + LEGEND
}

/// What a picture is made of, in drawing order.
enum Shape {
    /// A filled box, with what it is (an SVG tooltip).
    Rect {
        x: f64,
        y: f64,
        w: f64,
        h: f64,
        fill: [u8; 3],
        tooltip: Option<String>,
    },
    /// A vertical line.
    VLine { x: f64, y0: f64, y1: f64 },
    /// Text with its baseline at `y`, starting at `x` (or centred on it).
    Text {
        x: f64,
        y: f64,
        text: String,
        centred: bool,
        fill: [u8; 3],
    },
}

/// The rectangles of the spans: outer spans first so the units inside them (a layer's
/// forward inside the root's) are drawn on top.
fn span_boxes(ranks: &[RankTrace], window: (f64, f64), out: &mut Vec<Shape>) {
    let scale = (WIDTH - LEFT - RIGHT) / (window.1 - window.0).max(1.0);
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
            out.push(Shape::Rect {
                x: x0,
                y,
                w: (x1 - x0).max(0.5),
                h,
                fill: colour(&s.category),
                tooltip: Some(format!(
                    "{} ({:.3} ms)",
                    s.name,
                    (s.end_us - s.start_us) / 1000.0
                )),
            });
        }
    }
}

/// The whole picture of `ranks` over `window` (µs) under `title`.
fn shapes(ranks: &[RankTrace], window: (f64, f64), title: &str) -> Vec<Shape> {
    let text = |x: f64, y: f64, text: String, centred: bool, fill: [u8; 3]| Shape::Text {
        x,
        y,
        text,
        centred,
        fill,
    };
    let mut out = vec![text(LEFT, 18.0, title.to_string(), false, BLACK)];
    for i in 0..ranks.len() {
        for lane in 0..2 {
            out.push(Shape::Rect {
                x: LEFT,
                y: TOP + i as f64 * RANK + lane as f64 * LANE,
                w: WIDTH - LEFT - RIGHT,
                h: LANE - 2.0,
                fill: LANE_BACKGROUND,
                tooltip: None,
            });
        }
    }
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
        out.push(Shape::VLine {
            x,
            y0: TOP - 8.0,
            y1: bottom,
        });
        out.push(text(x, TOP - 10.0, format!("{t} ms"), true, GREY));
        t += tick;
    }
    for (i, r) in ranks.iter().enumerate() {
        let y = TOP + i as f64 * RANK;
        for (lane, label) in ["compute", "communication"].iter().enumerate() {
            let baseline = y + lane as f64 * LANE + LANE * 0.65;
            out.push(text(
                8.0,
                baseline,
                format!("rank {} {label}", r.rank),
                false,
                BLACK,
            ));
        }
    }
    span_boxes(ranks, window, &mut out);
    let ly = height(ranks.len()) - LEGEND + 14.0;
    let mut lx = LEFT;
    for (_, label, fill) in KINDS {
        out.push(Shape::Rect {
            x: lx,
            y: ly - 10.0,
            w: 14.0,
            h: 12.0,
            fill,
            tooltip: None,
        });
        out.push(text(lx + 18.0, ly, label.to_string(), false, BLACK));
        lx += 30.0 + label.len() as f64 * CHAR;
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
    let rgb = |[r, g, b]: [u8; 3]| format!("rgb({r},{g},{b})");
    for shape in shapes(ranks, window, title) {
        let _ = match shape {
            Shape::Rect {
                x,
                y,
                w,
                h,
                fill,
                tooltip: Some(tip),
            } => writeln!(
                out,
                r#"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{}" stroke="white" stroke-width="0.3"><title>{}</title></rect>"#,
                rgb(fill),
                escape(&tip)
            ),
            Shape::Rect {
                x, y, w, h, fill, ..
            } => writeln!(
                out,
                r#"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{}"/>"#,
                rgb(fill)
            ),
            Shape::VLine { x, y0, y1 } => writeln!(
                out,
                r#"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{y1}" stroke="{}"/>"#,
                rgb(GRID)
            ),
            Shape::Text {
                x,
                y,
                text,
                centred,
                fill,
            } => writeln!(
                out,
                r#"<text x="{x:.1}" y="{y:.1}"{} fill="{}">{}</text>"#,
                if centred {
                    r#" text-anchor="middle""#
                } else {
                    ""
                },
                rgb(fill),
                escape(&text)
            ),
        };
    }
    out.push_str("</svg>\n");
    out
}

/// An RGB canvas, white to start with.
struct Canvas {
    w: usize,
    h: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    fn fill(&mut self, x: f64, y: f64, bw: f64, bh: f64, c: [u8; 3]) {
        let (x0, x1) = (x.max(0.0) as usize, ((x + bw).ceil() as usize).min(self.w));
        let (y0, y1) = (y.max(0.0) as usize, ((y + bh).ceil() as usize).min(self.h));
        for row in y0..y1 {
            for col in x0..x1.max(x0 + 1).min(self.w) {
                self.pixels[(row * self.w + col) * 3..][..3].copy_from_slice(&c);
            }
        }
    }

    /// `text` with its baseline at `y` (the glyphs' baseline is 4 px above their bottom).
    fn text(&mut self, x: f64, y: f64, text: &str, centred: bool, c: [u8; 3]) {
        let advance = get_raster_width(FontWeight::Regular, RasterHeight::Size16);
        let width = text.chars().count() * advance;
        let left = if centred { x - width as f64 / 2.0 } else { x };
        let top = y.round() as i64 - 12;
        for (i, ch) in text.chars().enumerate() {
            let glyph = get_raster(ch, FontWeight::Regular, RasterHeight::Size16)
                .or_else(|| get_raster('?', FontWeight::Regular, RasterHeight::Size16));
            let Some(glyph) = glyph else { continue };
            let gx = left.round() as i64 + (i * advance) as i64;
            for (dy, row) in glyph.rows().enumerate() {
                for (dx, &alpha) in row.iter().enumerate() {
                    let (px, py) = (gx + dx as i64, top + dy as i64);
                    if alpha == 0
                        || px < 0
                        || py < 0
                        || px as usize >= self.w
                        || py as usize >= self.h
                    {
                        continue;
                    }
                    let at = (py as usize * self.w + px as usize) * 3;
                    let a = u32::from(alpha);
                    for (under, &ink) in self.pixels[at..at + 3].iter_mut().zip(&c) {
                        *under = ((u32::from(ink) * a + u32::from(*under) * (255 - a)) / 255) as u8;
                    }
                }
            }
        }
    }
}

/// The step as PNG: the SVG's shapes and text, rasterised.
pub(super) fn png(
    ranks: &[RankTrace],
    window: (f64, f64),
    title: &str,
) -> Result<Vec<u8>, png::EncodingError> {
    let (w, h) = (WIDTH as usize, height(ranks.len()) as usize);
    let mut canvas = Canvas {
        w,
        h,
        pixels: vec![255u8; w * h * 3],
    };
    for shape in shapes(ranks, window, title) {
        match shape {
            Shape::Rect {
                x, y, w, h, fill, ..
            } => canvas.fill(x, y, w, h, fill),
            Shape::VLine { x, y0, y1 } => canvas.fill(x, y0, 1.0, y1 - y0, GRID),
            Shape::Text {
                x,
                y,
                text,
                centred,
                fill,
            } => canvas.text(x, y, &text, centred, fill),
        }
    }
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, w as u32, h as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        encoder.set_compression(png::Compression::High);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&canvas.pixels)?;
        writer.finish()?;
    }
    Ok(out)
}
