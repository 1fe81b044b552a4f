//! A chart as a list of shapes, drawn as SVG text; the PNG is that SVG rendered by
//! `resvg` (text in DejaVu Sans Mono, embedded from `fonts/`, so a machine without fonts
//! draws the same picture).

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
        color: std::borrow::Cow<'static, str>,
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

impl Shape {
    /// The same shape `dy` pixels lower.
    fn moved_down(self, dy: f64) -> Shape {
        match self {
            Shape::Line {
                x1,
                y1,
                x2,
                y2,
                color,
                width,
            } => Shape::Line {
                x1,
                y1: y1 + dy,
                x2,
                y2: y2 + dy,
                color,
                width,
            },
            Shape::Rect { x, y, w, h, color } => Shape::Rect {
                x,
                y: y + dy,
                w,
                h,
                color,
            },
            Shape::Polyline { points, color, width } => Shape::Polyline {
                points: points.into_iter().map(|(x, y)| (x, y + dy)).collect(),
                color,
                width,
            },
            Shape::Text {
                x,
                y,
                size,
                anchor,
                text,
            } => Shape::Text {
                x,
                y: y + dy,
                size,
                anchor,
                text,
            },
        }
    }
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

    /// `scenes` one below the other, as wide as the widest.
    pub fn stacked(scenes: Vec<Scene>) -> Scene {
        let w = scenes.iter().map(|s| s.w).fold(0.0, f64::max);
        let mut out = Scene::new(w, scenes.iter().map(|s| s.h).sum());
        let mut top = 0.0;
        for s in scenes {
            out.shapes
                .extend(s.shapes.into_iter().map(|shape| shape.moved_down(top)));
            top += s.h;
        }
        out
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

    /// The scene as a PNG image: [`Scene::to_svg`] rendered by `resvg`.
    pub fn to_png(&self) -> Vec<u8> {
        use resvg::{tiny_skia, usvg};
        const FONT: &[u8] = include_bytes!("fonts/DejaVuSansMono.ttf");
        const FAMILY: &str = "DejaVu Sans Mono";
        let mut opt = usvg::Options::default();
        opt.fontdb_mut().load_font_data(FONT.to_vec());
        opt.fontdb_mut().set_sans_serif_family(FAMILY);
        opt.font_family = FAMILY.into();
        let tree = usvg::Tree::from_str(&self.to_svg(), &opt).expect("our own SVG parses");
        let size = tree.size().to_int_size();
        let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height()).expect("a non-empty scene");
        resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
        pixmap.encode_png().expect("an in-memory PNG encodes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_and_svg_draw_the_same_scene() {
        let mut s = Scene::new(300.0, 200.0);
        s.push(Shape::Rect {
            x: 10.0,
            y: 10.0,
            w: 20.0,
            h: 30.0,
            color: "#d62728".into(),
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
        let img = resvg::tiny_skia::Pixmap::decode_png(&png).unwrap();
        assert_eq!((img.width(), img.height()), (300, 200));
        let px = |x: u32, y: u32| {
            let p = img.pixel(x, y).unwrap().demultiply();
            [p.red(), p.green(), p.blue()]
        };
        assert_eq!(px(15, 20), [0xd6, 0x27, 0x28], "inside the rectangle");
        assert!(
            px(200, 100).iter().all(|&c| c < 160),
            "on the axis line: {:?}",
            px(200, 100)
        );
        assert_eq!(px(250, 30), [255, 255, 255], "background");
        let blue = px(100, 120);
        assert!(blue[2] > blue[0] && blue[2] > 150, "a polyline vertex: {blue:?}");
        let ink = (45..62)
            .flat_map(|y| (90..210).map(move |x| (x, y)))
            .filter(|&(x, y)| px(x, y).iter().all(|&c| c < 128))
            .count();
        assert!(ink > 40, "the text left {ink} dark pixels");
    }
}
