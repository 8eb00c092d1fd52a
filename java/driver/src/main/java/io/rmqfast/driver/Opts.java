package io.rmqfast.driver;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

/**
 * Command line: {@code SCENARIO [--key value | --key=value | --flag] ...}.
 * A {@code --key} followed by another {@code --option} (or nothing) is a boolean flag set to true.
 */
final class Opts {
    final String scenario;
    private final Map<String, String> values = new LinkedHashMap<>();
    private final Set<String> used = new LinkedHashSet<>();

    Opts(String[] args) {
        if (args.length == 0 || args[0].startsWith("--")) {
            throw new IllegalArgumentException("first argument must be the scenario name");
        }
        scenario = args[0];
        for (int i = 1; i < args.length; i++) {
            String a = args[i];
            if (!a.startsWith("--") || a.length() == 2) {
                throw new IllegalArgumentException("unexpected argument: " + a);
            }
            String key = a.substring(2);
            String val;
            int eq = key.indexOf('=');
            if (eq >= 0) {
                val = key.substring(eq + 1);
                key = key.substring(0, eq);
            } else if (i + 1 < args.length && !args[i + 1].startsWith("--")) {
                val = args[++i];
            } else {
                val = "true";
            }
            values.put(key, val);
        }
    }

    Map<String, String> all() {
        return values;
    }

    boolean has(String key) {
        used.add(key);
        return values.containsKey(key);
    }

    String str(String key, String dflt) {
        used.add(key);
        String v = values.get(key);
        return v == null ? dflt : v;
    }

    String required(String key) {
        used.add(key);
        String v = values.get(key);
        if (v == null || v.isEmpty()) {
            throw new IllegalArgumentException("missing required option --" + key);
        }
        return v;
    }

    int integer(String key, int dflt) {
        String v = str(key, null);
        return v == null ? dflt : Integer.parseInt(v.trim());
    }

    long lng(String key, long dflt) {
        String v = str(key, null);
        return v == null ? dflt : Long.parseLong(v.trim());
    }

    boolean bool(String key, boolean dflt) {
        String v = str(key, null);
        if (v == null) {
            return dflt;
        }
        String t = v.trim().toLowerCase();
        return t.equals("true") || t.equals("1") || t.equals("yes") || t.equals("on");
    }

    /** Comma separated list; an empty string yields a list with one empty element. */
    List<String> list(String key, String dflt) {
        String v = str(key, dflt);
        if (v == null) {
            return new ArrayList<>();
        }
        return new ArrayList<>(Arrays.asList(v.split(",", -1)));
    }

    /** Options that were given but never read by the scenario (reported, not fatal). */
    List<String> unused() {
        List<String> out = new ArrayList<>();
        for (String k : values.keySet()) {
            if (!used.contains(k)) {
                out.add(k);
            }
        }
        return out;
    }
}
