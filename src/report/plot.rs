//! A chart as a list of shapes, drawn two ways: SVG text and a PNG image (a small software
//! rasterizer with a 5×7 bitmap font and a small PNG encoder over zlib, so the report needs
//! no image library).

use std::fmt::Write as _;

/// One thing to draw, in pixels from the top left.
#[derive(Debug, Clone)]
pub enum Shape {
    /// A straight line.
    Line {
        x1: f64,
        y1: f64,
        x2: f64,
        y2: f64,
        color: &'static str,
        width: f64,
    },
    /// A filled rectangle.
    Rect {
        x: f64,
        y: f64,
        w: f64,
        h: f64,
        color: &'static str,
    },
    /// Connected line segments.
    Polyline {
        points: Vec<(f64, f64)>,
        color: &'static str,
        width: f64,
    },
    /// Text whose baseline is at `y`; `anchor` is start, middle or end.
    Text {
        x: f64,
        y: f64,
        size: f64,
        anchor: &'static str,
        text: String,
    },
}

/// A picture of `w` × `h` pixels on white.
#[derive(Debug, Clone)]
pub struct Scene {
    /// Width in pixels.
    pub w: f64,
    /// Height in pixels.
    pub h: f64,
    /// What to draw, in order.
    pub shapes: Vec<Shape>,
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

impl Scene {
    /// A blank scene.
    pub fn new(w: f64, h: f64) -> Self {
        Scene {
            w,
            h,
            shapes: Vec::new(),
        }
    }

    /// Adds a shape.
    pub fn push(&mut self, s: Shape) {
        self.shapes.push(s);
    }

    /// The scene as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let (w, h) = (self.w, self.h);
        let mut s = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>"#
        );
        for shape in &self.shapes {
            let _ = match shape {
                Shape::Line {
                    x1,
                    y1,
                    x2,
                    y2,
                    color,
                    width,
                } => write!(
                    s,
                    r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{color}" stroke-width="{width}"/>"#
                ),
                Shape::Rect { x, y, w, h, color } => {
                    write!(
                        s,
                        r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{color}"/>"#
                    )
                }
                Shape::Polyline { points, color, width } => {
                    let p: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
                    write!(
                        s,
                        r#"<polyline fill="none" stroke="{color}" stroke-width="{width}" points="{}"/>"#,
                        p.join(" ")
                    )
                }
                Shape::Text {
                    x,
                    y,
                    size,
                    anchor,
                    text,
                } => write!(
                    s,
                    r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{anchor}">{}</text>"#,
                    xml(text)
                ),
            };
        }
        s.push_str("</svg>");
        s
    }

    /// The scene as a PNG image (8-bit RGB).
    pub fn to_png(&self) -> Vec<u8> {
        let mut c = Canvas::new(self.w as usize, self.h as usize);
        for shape in &self.shapes {
            match shape {
                Shape::Line {
                    x1,
                    y1,
                    x2,
                    y2,
                    color,
                    width,
                } => c.line(*x1, *y1, *x2, *y2, rgb(color), *width),
                Shape::Rect { x, y, w, h, color } => c.rect(*x, *y, *w, *h, rgb(color)),
                Shape::Polyline { points, color, width } => {
                    for p in points.windows(2) {
                        c.line(p[0].0, p[0].1, p[1].0, p[1].1, rgb(color), *width);
                    }
                }
                Shape::Text {
                    x,
                    y,
                    size,
                    anchor,
                    text,
                } => c.text(*x, *y, *size, anchor, text),
            }
        }
        c.png()
    }
}

/// `#rrggbb` (or `#rgb`) as bytes; black when malformed.
fn rgb(color: &str) -> [u8; 3] {
    let h = color.trim_start_matches('#');
    let full: String = if h.len() == 3 {
        h.chars().flat_map(|c| [c, c]).collect()
    } else {
        h.to_string()
    };
    let byte = |i: usize| {
        full.get(i..i + 2)
            .and_then(|s| u8::from_str_radix(s, 16).ok())
            .unwrap_or(0)
    };
    [byte(0), byte(2), byte(4)]
}

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Canvas {
            w,
            h,
            px: vec![255; w * h * 3],
        }
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, c: [u8; 3]) {
        for yy in y.round() as i64..(y + h).round() as i64 {
            for xx in x.round() as i64..(x + w).round() as i64 {
                self.set(xx, yy, c);
            }
        }
    }

    fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, c: [u8; 3], width: f64) {
        let steps = ((x2 - x1).abs().max((y2 - y1).abs()) * 2.0).ceil().max(1.0) as usize;
        let r = (width / 2.0).max(0.5);
        for i in 0..=steps {
            let t = i as f64 / steps as f64;
            let (x, y) = (x1 + (x2 - x1) * t, y1 + (y2 - y1) * t);
            // A square pen of the line's width.
            for yy in (y - r + 0.5).floor() as i64..=(y + r - 0.5).floor() as i64 {
                for xx in (x - r + 0.5).floor() as i64..=(x + r - 0.5).floor() as i64 {
                    self.set(xx, yy, c);
                }
            }
        }
    }

    fn text(&mut self, x: f64, y: f64, size: f64, anchor: &str, text: &str) {
        let scale = if size >= 16.0 { 2 } else { 1 } as i64;
        let advance = 6 * scale;
        let width = text.chars().count() as i64 * advance;
        let mut cx = match anchor {
            "middle" => x as i64 - width / 2,
            "end" => x as i64 - width,
            _ => x as i64,
        };
        let top = y as i64 - 7 * scale;
        for ch in text.chars() {
            let rows = glyph(ch);
            for (ry, row) in rows.iter().enumerate() {
                for rx in 0..5 {
                    if row & (0x10 >> rx) != 0 {
                        for dy in 0..scale {
                            for dx in 0..scale {
                                self.set(cx + rx * scale + dx, top + ry as i64 * scale + dy, [0, 0, 0]);
                            }
                        }
                    }
                }
            }
            cx += advance;
        }
    }

    fn png(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity((self.w * 3 + 1) * self.h);
        for row in self.px.chunks(self.w * 3) {
            raw.push(0); // filter: none
            raw.extend_from_slice(row);
        }
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&(self.w as u32).to_be_bytes());
        ihdr.extend_from_slice(&(self.h as u32).to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, no filter, no interlace
        chunk(&mut out, b"IHDR", &ihdr);
        chunk(&mut out, b"IDAT", &zlib(&raw));
        chunk(&mut out, b"IEND", &[]);
        out
    }
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A zlib stream of `data` (charts are mostly flat colour: about 100× smaller than raw).
fn zlib(data: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    z.write_all(data).expect("writing to a Vec cannot fail");
    z.finish().expect("writing to a Vec cannot fail")
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xffff_ffffu32;
    for &byte in data {
        c ^= byte as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

/// A 5×7 glyph (rows top to bottom, bit 4 = leftmost column); letters are drawn as
/// capitals; unknown characters as a box.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        ' ' => [0; 7],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        '-' | '−' => [0, 0, 0, 0x1F, 0, 0, 0],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '/' => [0, 0x01, 0x02, 0x04, 0x08, 0x10, 0],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        '<' => [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02],
        '>' => [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08],
        '[' => [0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E],
        ']' => [0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E],
        '\'' => [0x04, 0x04, 0x08, 0, 0, 0, 0],
        '?' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04],
        '*' | '×' => [0, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0],
        _ => [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes our own PNGs, checking every CRC and the Adler-32.
    fn decode(png: &[u8]) -> (usize, usize, Vec<u8>) {
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let (mut i, mut w, mut h, mut idat) = (8, 0, 0, Vec::new());
        while i < png.len() {
            let n = u32::from_be_bytes(png[i..i + 4].try_into().unwrap()) as usize;
            let kind = &png[i + 4..i + 8];
            let data = &png[i + 8..i + 8 + n];
            let crc = u32::from_be_bytes(png[i + 8 + n..i + 12 + n].try_into().unwrap());
            assert_eq!(
                crc,
                crc32(&png[i + 4..i + 8 + n]),
                "CRC of {:?}",
                std::str::from_utf8(kind)
            );
            match kind {
                b"IHDR" => {
                    w = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
                    h = u32::from_be_bytes(data[4..8].try_into().unwrap()) as usize;
                    assert_eq!(&data[8..], &[8, 2, 0, 0, 0]);
                }
                b"IDAT" => idat.extend_from_slice(data),
                _ => {}
            }
            i += 12 + n;
        }
        // The zlib decoder checks the Adler-32 of what it inflates.
        let mut raw = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::ZlibDecoder::new(&idat[..]), &mut raw).unwrap();
        assert_eq!(raw.len(), (w * 3 + 1) * h);
        (w, h, raw)
    }

    #[test]
    fn png_and_svg_draw_the_same_scene() {
        let mut s = Scene::new(300.0, 200.0);
        s.push(Shape::Rect {
            x: 10.0,
            y: 10.0,
            w: 20.0,
            h: 30.0,
            color: "#d62728",
        });
        s.push(Shape::Line {
            x1: 0.0,
            y1: 100.0,
            x2: 299.0,
            y2: 100.0,
            color: "#000",
            width: 1.0,
        });
        s.push(Shape::Polyline {
            points: vec![(50.0, 150.0), (100.0, 120.0), (150.0, 180.0)],
            color: "#1f77b4",
            width: 1.5,
        });
        s.push(Shape::Text {
            x: 150.0,
            y: 60.0,
            size: 12.0,
            anchor: "middle",
            text: "Reward 0.5 <x>".into(),
        });
        let svg = s.to_svg();
        assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.contains("Reward 0.5 &lt;x&gt;"));
        let png = s.to_png();
        let (w, h, raw) = decode(&png);
        assert_eq!((w, h), (300, 200));
        assert!(
            png.len() * 20 < raw.len(),
            "{} bytes for {} raw: not compressed",
            png.len(),
            raw.len()
        );
        let px = |x: usize, y: usize| {
            let i = y * (w * 3 + 1) + 1 + x * 3;
            [raw[i], raw[i + 1], raw[i + 2]]
        };
        assert_eq!(px(15, 20), [0xd6, 0x27, 0x28], "inside the rectangle");
        assert_eq!(px(200, 100), [0, 0, 0], "on the axis line");
        assert_eq!(px(250, 30), [255, 255, 255], "background");
        assert_eq!(px(100, 120), [0x1f, 0x77, 0xb4], "a polyline vertex");
        let ink = (50..60)
            .flat_map(|y| (100..200).map(move |x| (x, y)))
            .filter(|&(x, y)| px(x, y) == [0, 0, 0])
            .count();
        assert!(ink > 40, "the text left {ink} dark pixels");
        assert_eq!(rgb("#abc"), [0xaa, 0xbb, 0xcc]);
    }
}
