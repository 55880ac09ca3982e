// Stands in for the notebook template's MathJax 2 from a CDN: MathJax 3, served from this
// site, typesets every page (mathjax-config.js, then mathjax/tex-chtml.js).
