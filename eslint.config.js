// Type-aware lint: the rules that catch the bugs a storage driver cannot afford
// (a forgotten await, a non-exhaustive switch over a CSI enum, a promise where a boolean was meant).
import js from '@eslint/js';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['dist/', 'node_modules/', 'src/gen/', 'coverage/', 'sanity/out/'] },
  js.configs.recommended,
  ...tseslint.configs.strictTypeChecked,
  {
    languageOptions: {
      parserOptions: { projectService: true, tsconfigRootDir: import.meta.dirname },
    },
    rules: {
      '@typescript-eslint/no-floating-promises': 'error',
      '@typescript-eslint/no-misused-promises': 'error',
      '@typescript-eslint/switch-exhaustiveness-check': 'error',
      '@typescript-eslint/restrict-template-expressions': [
        'error',
        { allowNumber: true, allowBoolean: true },
      ],
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_' }],
      '@typescript-eslint/no-non-null-assertion': 'error',
      'no-console': 'error',
      eqeqeq: 'error',
    },
  },
  {
    files: ['**/*.js', '**/*.mjs'],
    extends: [tseslint.configs.disableTypeChecked],
    languageOptions: {
      globals: {
        process: 'readonly',
        console: 'readonly',
        performance: 'readonly',
        setTimeout: 'readonly',
        Buffer: 'readonly',
      },
    },
  },
  {
    files: ['test/**', 'bench/**', 'sanity/**'],
    rules: {
      'no-console': 'off',
      // vitest's toMatchObject counts a bare regex (in an object or an array) as matching any value.
      'no-restricted-syntax': [
        'error',
        {
          selector:
            "CallExpression[callee.property.name='toMatchObject'] :matches(Property, ArrayExpression) > Literal[regex]",
          message: 'A bare regex here matches anything; use expect.stringMatching(/…/).',
        },
      ],
    },
  },
);
