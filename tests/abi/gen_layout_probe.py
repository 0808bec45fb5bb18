#!/usr/bin/env python3
"""Writes strata_layout_probe.c from include/strata/strata.h: a C99 program that prints, as JSON,
the compiler's sizeof and offsetof of every field of every struct the header declares (with the
field's declared type), and the value of every integer STRATA_* macro. tests/python/
test_abi_layout.py compares that with the Python bindings' ctypes declarations.

The program is generated, not written by hand, so a field or struct added to the header is
checked without anyone remembering to list it. It also carries compile-time checks (C99
negative-size arrays) that the parse is faithful and that every STRATA_*_STRUCT_SIZE macro ends
at its struct's last field: a field appended without moving the macro fails the build.

Usage: gen_layout_probe.py include/strata/strata.h out.c
The parser knows the header's own style (clang-formatted C99: `typedef struct [tag] { ... } name;`,
fields `type name;`, `type a, b;`, `type name[N];`, one function pointer); anything else in a
struct body is an error naming the line, never silently skipped."""
import re
import sys

COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
STRUCT = re.compile(r"typedef\s+struct\s*\w*\s*\{([^{}]*)\}\s*(\w+)\s*;")
ENUM = re.compile(r"typedef\s+enum\s*\w*\s*\{[^{}]*\}\s*(\w+)\s*;")
SCALAR_TYPEDEF = re.compile(r"typedef\s+([a-z0-9_]+)\s+(\w+)\s*;")
SIZE_MACRO = re.compile(
    r"#define\s+(STRATA_\w+_STRUCT_SIZE)\s*\\?\s*STRATA_STRUCT_SIZE\(\s*(\w+)\s*,\s*(\w+)\s*\)")
INT_MACRO = re.compile(r"^#define\s+(STRATA_[A-Z0-9_]+)[ \t]+(?!\()(.+?)\s*$", re.M)
FUNCTION_POINTER = re.compile(r"^(.*?)\(\s*\*\s*(\w+)\s*\)\s*\((.*)\)$", re.S)
DECLARATOR = re.compile(r"^(.*?)([\s*]*)\b(\w+)\s*((?:\[[^\]]*\]\s*)*)$", re.S)


def fail(message):
    sys.exit("gen_layout_probe.py: %s" % message)


def without_experimental(text):
    """The header minus its STRATA_EXPERIMENTAL section: no stability promise, no binding."""
    start = text.find("#ifdef STRATA_EXPERIMENTAL\n")
    if start < 0:
        return text
    end = text.find("#endif /* STRATA_EXPERIMENTAL */", start)
    if end < 0:
        fail("'#ifdef STRATA_EXPERIMENTAL' without '#endif /* STRATA_EXPERIMENTAL */'")
    return text[:start] + text[end:]


def split_top_level(text, separator):
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == separator and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def parse_fields(struct, body):
    """[(name, declared type, is_array)] in declaration order."""
    fields = []
    for declaration in split_top_level(body, ";"):
        declaration = " ".join(declaration.split())
        if not declaration:
            continue
        fp = FUNCTION_POINTER.match(declaration)
        if fp:
            fields.append((fp.group(2), "%s(*)(%s)" % (fp.group(1).strip(), fp.group(3)), False))
            continue
        declarators = split_top_level(declaration, ",")
        first = DECLARATOR.match(declarators[0])
        if not first or not first.group(1).strip():
            fail("%s: cannot read the field declaration '%s'" % (struct, declaration))
        base = first.group(1).strip()
        for i, text in enumerate(declarators):
            m = first if i == 0 else DECLARATOR.match(" " + text.strip())
            if not m or (i > 0 and m.group(1).strip()):
                fail("%s: cannot read the declarator '%s' of '%s'" % (struct, text, declaration))
            # "const char* const* a, b": the base is "const char* const", each declarator
            # adds its own stars.
            stars = m.group(2).replace(" ", "")
            ctype = base + " " + stars if stars else base
            fields.append((m.group(3), " ".join(ctype.split()), bool(m.group(4).strip())))
    if not fields:
        fail("%s has no fields" % struct)
    return fields


def c_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main():
    if len(sys.argv) != 3:
        fail("usage: gen_layout_probe.py strata.h out.c")
    header_path, out_path = sys.argv[1], sys.argv[2]
    raw = without_experimental(open(header_path).read())
    text = COMMENT.sub(" ", raw)

    structs = [(m.group(2), parse_fields(m.group(2), m.group(1))) for m in STRUCT.finditer(text)]
    if len(structs) < 10:
        fail("found only %d structs in %s" % (len(structs), header_path))
    names = {name for name, _ in structs}
    enums = set(ENUM.findall(text))
    typedefs = {alias: base for base, alias in SCALAR_TYPEDEF.findall(text)}
    macros = {}
    for macro, struct, field in SIZE_MACRO.findall(text):
        if struct not in names:
            fail("%s names an unknown struct %s" % (macro, struct))
        macros[struct] = (macro, field)
    for name, fields in structs:
        if fields[0][0] == "struct_size" and name not in macros:
            fail("%s starts with struct_size but has no STRATA_*_STRUCT_SIZE macro" % name)
    constants = []
    for macro, value in INT_MACRO.findall(text):
        if macro.endswith("_H_") or value.startswith("__attribute__"):
            continue
        constants.append(macro)

    out = ["/* Generated by tests/abi/gen_layout_probe.py from %s: do not edit. */" % header_path,
           "#include <stddef.h>", "#include <stdio.h>", "", '#include "strata/strata.h"', ""]
    # Compile-time checks: fields in declaration order without overlap (a faithful parse), and
    # each size macro at the end of its struct's last field.
    for name, fields in structs:
        for (a, _, _), (b, _, _) in zip(fields, fields[1:]):
            out.append("typedef char strata_layout_%s_%s_before_%s[(offsetof(%s, %s) + "
                       "sizeof(((%s*)0)->%s) <= offsetof(%s, %s)) ? 1 : -1];"
                       % (name, a, b, name, a, name, a, name, b))
        if name in macros:
            macro, _ = macros[name]
            last = fields[-1][0]
            out.append("typedef char %s_must_end_at_the_last_field_%s[(%s == offsetof(%s, %s) + "
                       "sizeof(((%s*)0)->%s)) ? 1 : -1];" % (macro, last, macro, name, last,
                                                               name, last))
    out += ["", "int main(void) {", '  printf("{\\"structs\\": {");']
    for i, (name, fields) in enumerate(structs):
        macro = macros.get(name, (None, None))[0]
        out.append('  printf("%s\\"%s\\": {\\"size\\": %%lu, \\"size_macro\\": %s, '
                   '\\"fields\\": [", (unsigned long)sizeof(%s)%s);'
                   % ("" if i == 0 else ", ", name, "%lu" if macro else "null", name,
                      ", (unsigned long)(%s)" % macro if macro else ""))
        for j, (field, ctype, is_array) in enumerate(fields):
            member = "((%s*)0)->%s" % (name, field)
            count = "(unsigned long)(sizeof(%s) / sizeof(%s[0]))" % (member, member) \
                if is_array else "0ul"
            out.append('  printf("%s{\\"name\\": \\"%s\\", \\"type\\": %s, \\"offset\\": %%lu, '
                       '\\"size\\": %%lu, \\"count\\": %%lu}", (unsigned long)offsetof(%s, %s), '
                       '(unsigned long)sizeof(%s), %s);'
                       % ("" if j == 0 else ", ", field, c_string(c_string(ctype))[1:-1], name,
                          field, member, count))
        out.append('  printf("]}");')
    out.append('  printf("}, \\"typedefs\\": {");')
    for i, (alias, base) in enumerate(sorted(typedefs.items())):
        out.append('  printf("%s\\"%s\\": \\"%s\\"");' % ("" if i == 0 else ", ", alias, base))
    out.append('  printf("}, \\"enums\\": [%s], \\"constants\\": {");'
               % ", ".join(c_string(c_string(e))[1:-1] for e in sorted(enums)))
    for i, macro in enumerate(constants):
        out.append('  printf("%s\\"%s\\": %%lld", (long long)(%s));'
                   % ("" if i == 0 else ", ", macro, macro))
    out += ['  printf("}}\\n");', "  return 0;", "}", ""]
    with open(out_path, "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    main()
