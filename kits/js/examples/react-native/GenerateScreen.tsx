// A React Native screen over the kit's react-native entry point: a prompt box, a button, the text as it
// streams. NOT RUN and not compiled in this project (no React Native toolchain, iOS/Android device or
// simulator in CI); the engine under it is the one the Node and Chromium tests run.
//
// App setup: npm install @edgespec/kit onnxruntime-react-native react-native-fs (plus `pod install` on
// iOS), and copy an edgespec bundle folder into the app's documents directory (download it on first
// launch, or ship it as an asset and copy it out).
import React, { useEffect, useRef, useState } from "react";
import { Button, ScrollView, Text, TextInput, View } from "react-native";
import RNFS from "react-native-fs";
import { Buffer } from "buffer";
import { type DeviceFiles, type Engine, openBundle } from "@edgespec/kit/react-native";

const BUNDLE = `${RNFS.DocumentDirectoryPath}/smollm2-bundle`;

// react-native-fs reads files as base64; the kit wants bytes. ONNX files are opened by path, not read.
const files: DeviceFiles = {
  readFile: async (path) => Uint8Array.from(Buffer.from(await RNFS.readFile(path, "base64"), "base64")),
  exists: (path) => RNFS.exists(path),
  size: async (path) => Number((await RNFS.stat(path)).size),
};

export default function GenerateScreen() {
  const engine = useRef<Engine | null>(null);
  const [status, setStatus] = useState("loading the model...");
  const [prompt, setPrompt] = useState("Write a haiku about caches.");
  const [output, setOutput] = useState("");
  const [busy, setBusy] = useState(true);

  useEffect(() => {
    let closed = false;
    openBundle(BUNDLE, files, { executionProviders: ["cpu"], nCtx: 2048 })
      .then((e) => {
        if (closed) return e.close();
        engine.current = e;
        setStatus("ready");
        setBusy(false);
      })
      .catch((err) => setStatus(`cannot open the bundle: ${err.message}`));
    return () => {
      closed = true;
      engine.current?.close();
    };
  }, []);

  async function generate() {
    if (!engine.current) return;
    setBusy(true);
    setOutput("");
    try {
      const stream = engine.current.stream(prompt, { mode: "lookup", maxTokens: 128, temperature: 0.7 });
      for await (const piece of stream) setOutput((text) => text + piece);
      setStatus(stream.result!.stats.summary());
    } catch (err) {
      setStatus(`error: ${(err as Error).message}`);
    } finally {
      setBusy(false);
    }
  }

  return (
    <View style={{ flex: 1, padding: 16, gap: 8 }}>
      <TextInput value={prompt} onChangeText={setPrompt} multiline style={{ borderWidth: 1, padding: 8, minHeight: 80 }} />
      <Button title="Generate" onPress={generate} disabled={busy} />
      <ScrollView style={{ flex: 1 }}><Text selectable>{output}</Text></ScrollView>
      <Text style={{ color: "#666", fontSize: 12 }}>{status}</Text>
    </View>
  );
}
