// onnxruntime-react-native is a peer dependency of the React Native app, not installed here (it needs
// react-native). Its API is onnxruntime-common's (it depends on onnxruntime-common 1.24.3), so the
// build types it as that.
declare module "onnxruntime-react-native" {
  export * from "onnxruntime-common";
}
