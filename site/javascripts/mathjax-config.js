// MathJax 3 settings for the book (this runs at the end of <body>, before MathJax loads).
// Chapters: pymdownx.arithmatex wraps each formula in an .arithmatex element as \( \) or \[ \];
// only those are typeset. Notebooks: markdown cells keep Jupyter's $ and $$.
const notebookPage = document.querySelector(".jupyter-wrapper") !== null;
window.MathJax = notebookPage
  ? {
      tex: {
        inlineMath: [["$", "$"], ["\\(", "\\)"]],
        displayMath: [["$$", "$$"], ["\\[", "\\]"]],
        processEscapes: true,
        processEnvironments: true,
      },
      options: { ignoreHtmlClass: "md-header|md-sidebar|md-footer|jp-OutputArea" },
    }
  : {
      tex: {
        inlineMath: [["\\(", "\\)"]],
        displayMath: [["\\[", "\\]"]],
        processEscapes: true,
        processEnvironments: true,
      },
      options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
    };
