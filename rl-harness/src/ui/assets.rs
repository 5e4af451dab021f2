//! The page's files, embedded in the binary at build time (no Node build step, nothing read
//! from disk at run time): the HTML, the plain JavaScript modules, the stylesheet, and the
//! vendored uPlot with its licence (`rl-harness/ui/vendor/uplot/README.md` says where it came
//! from).

/// One embedded file.
pub(super) struct Asset {
    /// Its `Content-Type`.
    pub(super) content_type: &'static str,
    /// Its bytes.
    pub(super) body: &'static [u8],
}

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

macro_rules! embedded {
    ($($path:literal => $file:literal, $type:expr;)*) => {
        /// The file served at `path`.
        pub(super) fn find(path: &str) -> Option<Asset> {
            match path {
                $($path => Some(Asset {
                    content_type: $type,
                    body: include_bytes!(concat!("../../ui/", $file)),
                }),)*
                _ => None,
            }
        }
    };
}

embedded! {
    "/" => "index.html", "text/html; charset=utf-8";
    "/style.css" => "style.css", CSS;
    "/js/app.js" => "js/app.js", JS;
    "/js/util.js" => "js/util.js", JS;
    "/js/state.js" => "js/state.js", JS;
    "/js/runs.js" => "js/runs.js", JS;
    "/js/chart.js" => "js/chart.js", JS;
    "/js/run.js" => "js/run.js", JS;
    "/js/compare.js" => "js/compare.js", JS;
    "/vendor/uPlot.iife.min.js" => "vendor/uplot/uPlot.iife.min.js", JS;
    "/vendor/uPlot.min.css" => "vendor/uplot/uPlot.min.css", CSS;
    "/vendor/LICENSE" => "vendor/uplot/LICENSE", "text/plain; charset=utf-8";
}
